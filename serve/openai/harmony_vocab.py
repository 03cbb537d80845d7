"""openai-harmony's vocabulary, offline.

openai-harmony (gpt-oss's message format) needs the o200k_base BPE ranks to build its encoding
and downloads them from openaipublic.blob.core.windows.net on first use, unless
TIKTOKEN_ENCODINGS_BASE names a folder that holds `o200k_base.tiktoken`. A server (or CI) with no
internet would fail there, so the file is taken from bpe-openai's package data instead (it ships
the same ranks gzipped), unzipped once into `<baton cache>/tiktoken`, and the variable pointed at
it. A user who set TIKTOKEN_ENCODINGS_BASE keeps their own folder.
"""

from __future__ import annotations

import functools
import gzip
import logging
import os
import shutil
import tempfile
from pathlib import Path

from baton.common.corpus import cache_root

log = logging.getLogger(__name__)
ENV = "TIKTOKEN_ENCODINGS_BASE"
FILE = "o200k_base.tiktoken"


def ensure_vocab() -> Path:
    """The folder openai-harmony reads o200k_base from (sets TIKTOKEN_ENCODINGS_BASE if unset)."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    folder = cache_root() / "tiktoken"
    target = folder / FILE
    if not target.exists():
        import bpe_openai  # only here: a user with their own folder needs no bpe-openai

        source = Path(bpe_openai.__file__).parent / "data" / (FILE + ".gz")
        folder.mkdir(parents=True, exist_ok=True)
        # unzip beside the target and rename: a concurrent reader never sees half a file
        with gzip.open(source, "rb") as src, tempfile.NamedTemporaryFile(dir=folder, delete=False) as tmp:
            shutil.copyfileobj(src, tmp)
        os.replace(tmp.name, target)
        log.info("harmony vocabulary: unzipped %s from bpe-openai's package data into %s", FILE, folder)
    os.environ[ENV] = str(folder)
    log.info("harmony vocabulary: %s=%s (o200k_base for openai-harmony, offline)", ENV, folder)
    return folder


@functools.cache
def harmony_encoding():
    """openai-harmony's gpt-oss encoding (HARMONY_GPT_OSS), loaded once per process."""
    ensure_vocab()
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
