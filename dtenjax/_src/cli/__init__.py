"""Layer 7: what ``python -m dtenjax`` runs: the demo and other commands. The top layer; imports
anything.
"""
