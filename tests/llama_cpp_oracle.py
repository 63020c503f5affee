"""llama.cpp as a test oracle: llama-cpp-python 0.3.36 (it vendors llama.cpp b10448's Kimi K3) and its sources.

`llama_cpp()` imports the package, building it from source with pip when it is missing (about half an hour on
two cores; pip's wheel cache keeps the build, so CI can cache ~/.cache/pip). `llama_cpp_source()` is the sdist
unpacked (llama.cpp's own `convert_hf_to_gguf.py` and its gguf-py, which knows `kimi-k3`), cached under
~/.cache/kimik3 (or $KIMIK3_LLAMA_CPP_SRC). Only the slow tests use this.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

VERSION = "0.3.36"
PACKAGE = f"llama-cpp-python=={VERSION}"
# the library alone: no multimodal helper, tests, examples, tools or server
CMAKE_ARGS = ("-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF "
              "-DLLAMA_BUILD_SERVER=OFF")


def llama_cpp():
    """The `llama_cpp` module at VERSION, installed from source into this interpreter's environment if missing."""
    try:
        import llama_cpp
    except ImportError:
        env = dict(os.environ, CMAKE_ARGS=os.environ.get("CMAKE_ARGS", CMAKE_ARGS),
                   CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2))
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-binary", "llama-cpp-python", PACKAGE],
                       env=env, check=True)
        import llama_cpp
    assert llama_cpp.__version__ == VERSION, f"llama-cpp-python {llama_cpp.__version__} installed, tests need {VERSION}"
    return llama_cpp


def llama_cpp_source() -> Path:
    """The vendored llama.cpp tree of the sdist (downloaded once with pip, unpacked, cached)."""
    root = Path(os.environ.get("KIMIK3_LLAMA_CPP_SRC", Path.home() / ".cache" / "kimik3" / f"llama-cpp-{VERSION}"))
    tree = root / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    if not (tree / "convert_hf_to_gguf.py").is_file():
        root.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", PACKAGE,
                        "-d", str(root)], check=True)
        with tarfile.open(root / f"llama_cpp_python-{VERSION}.tar.gz") as tar:
            tar.extractall(root, filter="data")
    return tree


# run llama.cpp's converter with one change: the pre-tokenizer is named by a hash of the released vocabulary's
# output, which another vocabulary (the demo's) cannot match, so the name is given (K3 keeps K2's pre-tokenizer)
_CONVERT = """
import runpy, sys
tree, src, out = sys.argv[1:]
sys.path[:0] = [tree + "/gguf-py", tree]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "kimi-k2"
sys.argv = ["convert_hf_to_gguf.py", src, "--outfile", out, "--outtype", "auto"]
runpy.run_path(tree + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def convert_with_llama_cpp(folder: Path, out: Path) -> Path:
    """llama.cpp's own converter on a checkpoint folder (its tokenizer files loaded with trust_remote_code)."""
    res = subprocess.run([sys.executable, "-c", _CONVERT, str(llama_cpp_source()), str(folder), str(out)],
                         stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0 and out.is_file(), res.stderr[-4000:]
    return out
