"""Collective algorithms: one module per algorithm, one record each, listed in ``registry.py``.

``base.py`` defines the :class:`~base.Call` a record is asked about and the
:class:`~base.Algorithm` record; ``registry.py`` lists the records and chooses among them. To add
an algorithm, write ``<name>.py`` with its record and add one line to ``registry.REGISTRY``.
"""
