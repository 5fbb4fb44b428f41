"""Layer 6: what ``python -m dtenjax`` runs: the demo and other commands. The top layer; imports
anything.
"""
