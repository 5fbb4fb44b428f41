"""dtenjax's native TCP transport, reached directly, for its benchmark (bench/transport.py).

Users reach the transport through ``dtenjax.all_reduce`` on CPU backends; a benchmark also needs
what sits under it: the process-wide counters (to prove a candidate ran on the transport), the
coordinator's key-value store (barriers and the per-rank results between timed runs), and the
extension's MAC primitives (HMAC-SHA256 against AES-256-GMAC). Not part of the library's API.
"""

from dtenjax._src.net.kvstore import default as key_value_store
from dtenjax._src.net.native import counters as counters
from dtenjax._src.net.native import ensure_crypto as ensure_crypto
from dtenjax._src.net.native import transport as transport

__all__ = ["counters", "ensure_crypto", "key_value_store", "transport"]
