"""The llama.cpp side of compare_frameworks.py: llama-cpp-python built on demand into its own venv
(a CPU build from the sdist on the package index; it is not a Baton dependency), the HF checkpoint
converted to GGUF by the converter that ships in that sdist, and the driver's generate loop.

    python benchmarks/compare_llamacpp.py CKPT OUT.gguf f32|bf16 SDIST_DIR   (the conversion alone)
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_vs_vllm import MAX_LEN, VOCAB  # the script dir is on sys.path

LLAMACPP_VERSION = "0.3.36"
LLAMACPP_CMAKE = (
    "-DLLAVA_BUILD=OFF -DGGML_NATIVE=ON -DGGML_OPENMP=ON -DLLAMA_BUILD_TESTS=OFF "
    "-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"
)
GGUF_TYPE = {"fp32": "f32", "bf16": "bf16"}


def load_llamacpp(job: dict):
    from llama_cpp import Llama

    n = job["threads"]
    llm = Llama(model_path=job["gguf"], n_ctx=MAX_LEN, n_threads=n, n_threads_batch=n, seed=0, verbose=False)

    def generate(work):
        outs = []
        for prompt, n in work:
            llm.reset()  # no KV reuse from the previous request (Llama.generate matches prefixes)
            tokens = []
            for token in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0):
                tokens.append(token)
                if len(tokens) == n:
                    break
            outs.append(tokens)
        return outs

    return generate


def convert_main(ckpt: str, out: str, outtype: str, src: str) -> None:
    """llama.cpp's convert_hf_to_gguf.py on the checkpoint. It has no tokenizer (token ids in, ids
    out), so the vocabulary written is a placeholder SentencePiece one of VOCAB entries."""
    root = Path(src) / "vendor" / "llama.cpp"
    sys.path[:0] = [str(root / "gguf-py"), str(root)]
    import convert_hf_to_gguf
    import gguf
    from conversion.llama import LlamaModel

    def set_vocab(self) -> None:
        t = gguf.TokenType
        tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
        types = [t.UNKNOWN, t.CONTROL, t.CONTROL] + [t.BYTE] * 256
        tokens += [f"<t{i}>" for i in range(len(tokens), VOCAB)]
        types += [t.NORMAL] * (VOCAB - len(types))
        self.gguf_writer.add_tokenizer_model("llama")
        self.gguf_writer.add_tokenizer_pre("default")
        self.gguf_writer.add_token_list(tokens)
        self.gguf_writer.add_token_scores([0.0] * VOCAB)
        self.gguf_writer.add_token_types(types)

    LlamaModel.set_vocab = set_vocab
    sys.argv = ["convert_hf_to_gguf.py", ckpt, "--outfile", out, "--outtype", outtype]
    convert_hf_to_gguf.main()


def ensure_llamacpp(venv: Path) -> tuple[Path, Path]:
    """(the venv's python, the unpacked sdist whose vendored llama.cpp has the GGUF converter)."""
    cache = venv.parent
    sdist = cache / f"llama_cpp_python-{LLAMACPP_VERSION}.tar.gz"
    src = cache / f"llama_cpp_python-{LLAMACPP_VERSION}"
    if not sdist.exists():
        dl = ["pip", "download", "--no-deps", "--no-binary", ":all:", f"llama-cpp-python=={LLAMACPP_VERSION}"]
        subprocess.run([sys.executable, "-m", *dl, "-d", str(cache)], check=True, capture_output=True)
    if not (src / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py").exists():
        with tarfile.open(sdist) as tar:
            tar.extractall(cache, filter="data")
    python = venv / "bin" / "python"
    check = [str(python), "-c", f"import llama_cpp, sys; sys.exit(llama_cpp.__version__ != {LLAMACPP_VERSION!r})"]
    if python.exists() and subprocess.run(check, capture_output=True, check=False).returncode == 0:
        return python, src
    log = cache / "llamacpp-build.log"
    print(f"building llama-cpp-python {LLAMACPP_VERSION} into {venv} (CPU, 2 jobs; log {log})", flush=True)
    subprocess.run(["python3", "-m", "venv", str(venv)], check=True)
    env = dict(os.environ, CMAKE_ARGS=LLAMACPP_CMAKE, CMAKE_BUILD_PARALLEL_LEVEL="2")
    with log.open("w") as f:
        for pkgs in (["numpy"], [str(sdist)]):
            proc = subprocess.run(
                [str(python), "-m", "pip", "install", "-v", *pkgs], env=env, stdout=f, stderr=f, check=False
            )
            if proc.returncode != 0:
                raise RuntimeError(f"pip install {pkgs[0]} failed (exit {proc.returncode}); see {log}")
    subprocess.run(check, check=True)
    return python, src


def to_gguf(ckpt: Path, dtype: str, src: Path) -> Path:
    out = ckpt.parent / f"{ckpt.name}.{GGUF_TYPE[dtype]}.gguf"
    if not out.exists():
        cmd = [sys.executable, __file__, str(ckpt), str(out), GGUF_TYPE[dtype], str(src)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"GGUF conversion failed:\n{proc.stderr[-3000:]}")
    return out


if __name__ == "__main__":
    convert_main(*sys.argv[1:5])
