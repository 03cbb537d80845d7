"""lm-evaluation-harness against the HTTP front: its `local-completions` model runs a local task
(JSONL + task YAML written here; nothing from a hub) and its results equal the references: the
loglikelihoods HF transformers computes for the same token ids, and the offline engine's greedy
generations for generate_until.

Offline needs: tokenizer_backend=huggingface with `tokenizer` = the checkpoint's own directory
(AutoTokenizer loads it locally; "auto" would probe the server for a remote tokenizer), and
tokenized_requests=True so lm-eval sends token ids - the ids it scores are then the ones it split
itself. lm-eval's API models need `tenacity` (the lm-eval[api] extra), so the test skips without it.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from baton.serve.engine import EngineConfig
from baton.serve.llm import LLM
from baton.serve.sampling_params import SamplingParams

from .server_fixtures import ServerThread

pytest.importorskip("tenacity", reason="lm-eval's API models need tenacity (pip install 'lm-eval[api]')")
lm_eval = pytest.importorskip("lm_eval")

DOCS = [
    {"context": "The quick brown", "continuation": " fox jumps", "question": "The lazy dog"},
    {"context": "def f(x):", "continuation": "\n    return x * 2", "question": "x * 2"},
    {"context": "Émigré naïve", "continuation": " café 🦊", "question": "café"},
]
TASKS = {
    "baton_ll": """output_type: loglikelihood
doc_to_text: "{{context}}"
doc_to_target: "{{continuation}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
""",
    "baton_gen": """output_type: generate_until
doc_to_text: "{{question}}"
doc_to_target: "{{continuation}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""",
}


def write_tasks(tmp) -> None:
    (tmp / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    for name, body in TASKS.items():
        head = f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tmp / 'docs.jsonl'}\n"
        (tmp / f"{name}.yaml").write_text(head + "test_split: test\n" + body)


@pytest.mark.slow
def test_lm_eval_local_completions_equals_the_references(llama_dir, tmp_path):
    from lm_eval.tasks import TaskManager

    write_tasks(tmp_path)
    server = ServerThread(llama_dir, num_kv_blocks=128, http_port=0)
    try:
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args={
                "base_url": f"http://127.0.0.1:{server.server.http_port}/v1/completions",
                "model": "tiny",
                "tokenizer": str(llama_dir),
                "tokenizer_backend": "huggingface",
                "tokenized_requests": True,
                "num_concurrent": 2,
                "max_retries": 1,
            },
            tasks=list(TASKS),
            task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),  # no index of the built-ins
            log_samples=True,
            bootstrap_iters=0,
        )
    finally:
        server.stop()
    samples = results["samples"]
    tok = transformers.AutoTokenizer.from_pretrained(llama_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama_dir.parent / "hf-llama").float().eval()
    got = {s["doc"]["context"]: s["resps"][0][0] for s in samples["baton_ll"]}
    assert len(got) == len(DOCS)
    for d in DOCS:  # lm-eval's split: encode(context + continuation), the context's tokens first
        whole = tok(d["context"] + d["continuation"])["input_ids"]
        n_ctx = len(tok(d["context"])["input_ids"])
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([whole])).logits[0].double(), -1)
        targets = torch.tensor(whole[n_ctx:])
        rows = lp[n_ctx - 1 : len(whole) - 1]
        ref = float(rows.gather(1, targets.unsqueeze(1)).sum())
        greedy = bool((rows.argmax(-1) == targets).all())
        ll, is_greedy = got[d["context"]]
        assert ll == pytest.approx(ref, abs=1e-4) and is_greedy == greedy
    llm = LLM(llama_dir, EngineConfig(num_kv_blocks=64, block_size=8))
    eos = tok.eos_token
    gens = {s["doc"]["question"]: s["resps"][0][0] for s in samples["baton_gen"]}
    for d in DOCS:
        ids = tok(d["question"])["input_ids"]
        ref = llm.generate(ids, SamplingParams(temperature=0, max_tokens=8, stop=["\n", eos]))[0].outputs[0].text
        assert gens[d["question"]] == ref
