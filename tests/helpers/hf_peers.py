"""A trainer and an engine around a tiny Hugging Face causal LM, for
tests/processes/test_hf_serving.py.

Run as ``python -m tests.helpers.hf_peers trainer|engine --endpoint ... [--model llama|gpt2]``; each
prints JSON lines. The model is built from a config with a fixed seed (nothing is
downloaded): a Llama with separate embeddings and head, or a GPT-2 whose ``lm_head.weight``
is tied to ``transformer.wte.weight`` (its ``state_dict()`` has both names).

- trainer: for each version, one SGD step on a random token batch, ``torch.save`` of the
  weights to ``--save-dir/v{version}.pt``, then ``send``; it prints ``sent`` and waits for
  a line on stdin before the next step (the test paces it on the engine's requests).
- engine: serves the model through a staged :class:`ModuleSink` (``--swap copy|pointer``);
  once the first version is live, ``--workers`` tasks run greedy-generation requests back to
  back, each inside a read lease, in a worker thread, and print ``request`` (prompt, output,
  version) for each, until stdin closes; ``finished`` says how many storages the embedding
  had while requests read it (two with pointer swap) and whether the head is still tied.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import anyio
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from aiosync import ModuleSink, SenderConfig, WeightReceiver, WeightSender
from aiosync.runtime import run

NEW_TOKENS = 8
VOCAB = 256
HANG = 120.0  # seconds: a hang guard for waits that normally take well under a second


def emit(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def deterministic() -> None:
    """The settings every process generates (and recomputes) with: one thread, no races."""
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)


MODELS = ("llama", "gpt2")


def build_model(kind: str = "llama") -> PreTrainedModel:
    """The tiny model every process builds the same way (random init, fixed seed)."""
    with torch.random.fork_rng(devices=[]):  # leave the caller's generator as it was
        torch.manual_seed(0)
        if kind == "gpt2":
            gpt2 = GPT2Config(
                vocab_size=VOCAB,
                n_positions=64,
                n_embd=64,
                n_layer=2,
                n_head=4,
                bos_token_id=0,
                eos_token_id=0,
                attn_implementation="eager",
            )
            return GPT2LMHeadModel(gpt2).eval()  # lm_head.weight is transformer.wte.weight
        llama = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=64,
            tie_word_embeddings=False,
            attn_implementation="eager",
        )
        return LlamaForCausalLM(llama).eval()


def generate(model: PreTrainedModel, prompt: list[int]) -> list[int]:
    """Greedy generation of ``NEW_TOKENS`` tokens after ``prompt`` (batch of one)."""
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(prompt) :]]


def trainer(args: argparse.Namespace) -> None:
    deterministic()
    model = build_model(args.model).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    batches = torch.Generator().manual_seed(1)
    save_dir = Path(args.save_dir)

    async def main() -> None:
        config = SenderConfig(buffer_bytes=1 << 20, timeout=60.0)
        async with WeightSender(args.endpoint, config=config) as sender:
            for version in range(args.versions):
                tokens = torch.randint(0, VOCAB, (4, 16), generator=batches)
                loss = model(input_ids=tokens, labels=tokens).loss
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                state = {n: t.detach().clone() for n, t in model.state_dict().items()}
                torch.save(state, save_dir / f"v{version}.pt")
                with anyio.fail_after(HANG):
                    await sender.send(model, version=version)
                emit("sent", version=version, loss=float(loss))
                if version + 1 < args.versions:
                    with anyio.fail_after(HANG):
                        line = await anyio.to_thread.run_sync(sys.stdin.readline)
                    if not line:
                        raise SystemExit("stdin closed before the next step")
        emit("done")

    run(main)


def engine(args: argparse.Namespace) -> None:
    deterministic()
    model = build_model(args.model)
    sink = ModuleSink(model, staged=True, swap=args.swap)
    embedding = model.get_input_embeddings().weight
    storages: set[int] = set()

    async def main() -> None:
        async with WeightReceiver(sink, args.endpoint) as receiver:
            emit("ready", endpoint=receiver.endpoint)
            stop = anyio.Event()

            async def watch_stdin() -> None:
                await anyio.to_thread.run_sync(sys.stdin.read)  # until the test closes it
                stop.set()

            async def requests(worker: int) -> None:
                rng = random.Random(worker)
                while not stop.is_set():
                    prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(3, 8))]
                    async with receiver.serving() as version:
                        if version is None:  # nothing live yet: skip
                            await anyio.sleep(0.01)
                            continue
                        output = await anyio.to_thread.run_sync(generate, model, prompt)
                        storages.add(embedding.data_ptr())
                    emit("request", worker=worker, prompt=prompt, output=output, version=version)

            async with anyio.create_task_group() as tg:
                tg.start_soon(watch_stdin)
                for worker in range(args.workers):
                    tg.start_soon(requests, worker)
            emit(
                "finished",
                version=receiver.current_version,
                failures=[str(f) for f in receiver.failures],
                storages=len(storages),  # of the input embedding, as requests read it
                tied=model.get_output_embeddings().weight is embedding,
            )

    run(main)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["engine", "trainer"])
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--save-dir", default=".")
    parser.add_argument("--versions", type=int, default=24)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--model", choices=MODELS, default="llama")
    parser.add_argument("--swap", choices=["copy", "pointer"], default="copy")
    args = parser.parse_args()
    trainer(args) if args.role == "trainer" else engine(args)
