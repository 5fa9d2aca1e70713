"""A checkpoint's matrices packed into panels, for either backend: the CPU kernels read them in host
memory, the GPU backend copies them to the device as they are. Layout only: packing moves bytes and
rounds nothing but fp16's one rounding at load.

  names.py       the dtypes, the matrix kinds and native's types, by name (no numba: the CLI reads them)
  layout.py      float panels and quantized panels (GGUF's blocks, rows side by side), kinds of mixed types
  intpanels.py   the integer mode's layout (the native panels; Q8_0's quants regrouped)
  repack.py      the packers' kernels (GGUF blocks and F16 rows moved into panels, in parallel)
  weights.py     a checkpoint packed for a dtype (fp32, fp16, native, int8)
  panelcache.py  packed panels kept on disk, checked, and mapped on later loads

Nothing here knows a backend: how the CPU kernels take these arrays is `backends/cpu/storage/`'s
business. The modules with numba kernels (repack, panelcache) import `numerics` first, whose cache
directory is keyed by this folder's sources too. This file imports nothing, so that a module of the
package can be imported without the others.
"""
