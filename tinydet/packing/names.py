"""What packing is asked for, by name: the dtypes, the matrix kinds a checkpoint packs into and the
ggml types native storage keeps as stored. No numba and no kernels here, so that the command line,
the memory check and the API can name them without importing the packers.
"""

from __future__ import annotations

from ..formats.ggml import GGML_TYPE_IDS, GGML_TYPES

DTYPES = ("fp32", "fp16", "native", "int8")

# The matrix kinds, each the row concatenation of its parts, stacked over layers.
MATRICES = (("wqkv", ("wq", "wk", "wv")), ("wo", ("wo",)), ("w13", ("w1", "w3")), ("w2", ("w2",)))
# A mixture of experts' matrix kinds (ModelConfig.n_experts) in place of w13 and w2: the router stacked
# over layers, each expert's [w1; w3] and w2 stacked over (layer, expert), layer l's expert e at
# l * n_experts + e.
MOE_MATRICES = (("router", ("router",)), ("w13e", ("w1", "w3")), ("w2e", ("w2",)))

#: ggml type ids the native path handles -> type name.
NATIVE_TYPES = {GGML_TYPE_IDS[t]: GGML_TYPES[GGML_TYPE_IDS[t]].name
                for t in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "MXFP4")}
