"""The ggml ops a drafter needs, as Context methods that check ggml's preconditions first.

ggml answers a violated precondition with GGML_ASSERT -> abort(); each method raises a ValueError
naming the problem instead. Shapes in messages are ggml order (ne0 first). The ops are grouped
by kind: `ops_layout`, `ops_math`, `ops_attention`, `ops_screen`, `ops_conv`; the checks they share are in `op_checks`.
"""

from __future__ import annotations

from .ops_attention import AttentionOps
from .ops_conv import ConvOps
from .ops_layout import LayoutOps
from .ops_math import MathOps
from .ops_screen import ScreenOps


class OpsMixin(LayoutOps, MathOps, AttentionOps, ScreenOps, ConvOps):
    """Graph-building ops; mixed into Context."""
