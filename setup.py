"""Builds flybatch's compiled core, `flybatch._core` (C++17 against the CPython API).

Each csrc/*.cpp is one stage of the core, module.cpp holds the Python bindings: a new stage is
a new file, and nothing here changes. FLYBATCH_SANITIZE=1 builds it with AddressSanitizer and
UBSan instead (`make asan`).
"""

import os
from glob import glob

from setuptools import Extension, setup

if os.environ.get("FLYBATCH_SANITIZE") == "1":
    # Stack variables are not instrumented (asan-stack=0): map_batched's greenlets switch
    # stacks by copying them, which ASan's shadow of the stack cannot follow (a value request
    # made inside a captured torch call switches with the core's frames on the stack, and their
    # redzones then read as overflows). Heap, globals and UBSan are checked.
    OPTIMIZE = ["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
                "--param=asan-stack=0", "-fno-sanitize-recover=undefined"]
    LINK = ["-fsanitize=address,undefined"]
else:
    # No -march=native: the module must run on any machine of the architecture it is copied to.
    OPTIMIZE, LINK = ["-O2"], []

setup(ext_modules=[Extension(
    "flybatch._core",
    sources=sorted(glob("csrc/*.cpp")),
    depends=sorted(glob("csrc/*.h")),
    language="c++",
    extra_compile_args=["-std=c++17", "-Wall", "-Wextra", *OPTIMIZE],
    extra_link_args=LINK,
)])
