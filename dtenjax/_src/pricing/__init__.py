"""Layer 3: what a collective costs and which algorithms can run it: the alpha-beta cost model
(``costmodel``, with the topology's calibration), the collective call (``calls``), each
algorithm's price record (``algorithms``: supports, order, cost) and the choice among them
(``registry``). Planning and the collectives both import it; it imports neither.
"""
