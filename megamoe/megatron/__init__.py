"""megatron-core integration: the MoELayer replacement, its gating conditions, and CPU compatibility.

Only this package and ``megamoe.train`` import ``megatron.core``.
"""

from megamoe.megatron.compat import apply_cpu_compat, stub_missing_triton

stub_missing_triton()  # megatron-core >= 0.19 imports triton unguarded; must run before megatron.core

from megamoe.megatron.moe_block import MegaMoEBlock  # noqa: E402
from megamoe.megatron.options import MegaMoEDecision, MegaMoEOptions, decide_mega_moe  # noqa: E402
from megamoe.megatron.spec import gpt_decoder_block_spec  # noqa: E402

__all__ = [
    "MegaMoEBlock",
    "MegaMoEDecision",
    "MegaMoEOptions",
    "apply_cpu_compat",
    "decide_mega_moe",
    "gpt_decoder_block_spec",
]
