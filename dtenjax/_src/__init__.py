"""dtenjax's implementation, in layers whose imports flow one way (docs/architecture.md).

    base          errors, config, ffi, hlo            (no dtenjax imports beyond each other)
    backends      net/  gpu/                          (base only)
    topology/                                         (base, net)
    planning/                                         (topology, base)
    collectives/  (passes/ on top of api)             (planning, topology, backends, base)
    compression/  serving/                            (collectives, backends, base)
    cli/                                              (anything)

``tests/test_architecture.py`` checks the direction and the absence of cycles.
"""
