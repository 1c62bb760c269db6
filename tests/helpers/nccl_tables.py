"""A canned nccl-tests output table (the documented format) for the preflight parsers."""

HEADER = """\
#                                                              out-of-place                       in-place
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
"""


BANNER = """\
# nThread 1 nGpus 1 minBytes 1048576 maxBytes 1073741824 step: 4(factor) warmup iters: 5 iters: 20 agg iters: 1 validation: 1 graph: 0
#
# Using devices
""" + "".join(f"#  Rank {r:2d} Group  0 Pid {4100 + r:6d} on gpu-{r // 8:03d} device  {r % 8} [0x{0x18 + r % 8:02x}] NVIDIA H200\n"
              for r in range(16)) + "#\n"


ALL_REDUCE = BANNER + HEADER + """\
     1048576        262144     float     sum      -1    48.31   21.71   40.70      0    47.95   21.87   41.00      0
     4194304       1048576     float     sum      -1    81.02   51.77   97.07      0    80.66   52.00   97.50      0
    16777216       4194304     float     sum      -1    172.4   97.31  182.46      0    171.9   97.60  183.00      0
    67108864      16777216     float     sum      -1    404.9  165.74  310.77      0    403.8  166.19  311.61      0
   268435456      67108864     float     sum      -1   1281.6  209.45  392.72      0   1279.0  209.88  393.52      0
  1073741824     268435456     float     sum      -1   4911.3  218.63  409.93      0   4905.2  218.90  410.44      0
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 237.1492
#
# Collective test concluded: all_reduce_perf
"""
