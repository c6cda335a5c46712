"""The one kernel layer of cutopo: CUDA source assembly, compilation and launches.

``source``  finds ``cuda_src/`` and builds one self-contained source string per family.
``compile`` turns (family, template instance, options) into a memoized CuPy kernel.
``launch``  checks every argument against the kernel's declared signature and launches it.
"""
