"""Suite ``tensor-parallel``: a Hugging Face model under its own tensor-parallel plan (``tp_plan="auto"``),
compiled with the backend, on two GPUs (NCCL), or two CPU processes (gloo, graphs emulated) with ``--smoke``.

    python -m benchmarks tensor-parallel [--variants llama-28L-1.5b] [--batches 1,4] [--tokens 32] [--dtype bfloat16]
    python -m benchmarks tensor-parallel --smoke      # CPU: two gloo ranks, the tiny Llama, fp32

The suite's child starts ``torchrun --standalone --nproc-per-node N -m benchmarks.tensor_parallel`` (this
module's ``main``, one process per rank) and hands on rank 0's rows.

Rank 0 saves a model with random weights (``hf.py``'s model keys) to a folder every rank
reads; each rank loads it with ``from_pretrained(folder, tp_plan="auto")``, transformers' own plan
(its row-parallel linears all-reduce through ``torch.distributed``, which Dynamo traces into the
graph's collectives). Per variant (``hf.prepare``) and batch: ``generate()`` greedy, ms
between decode steps (``hf.measure``), and the tokens against one process running the
whole model eagerly (rank 0, no ``tp_plan``): ``token_agreement`` (in fp32 it must be 1.0; in bf16
a near-tied logit of random weights may flip, so ``--agreement-from`` takes an fp32 run's). Rank 0
writes the rows ``{model, params, batch, variant, dtype, token_agreement, ms_per_token,
speedup_vs_eager, ...}``.
Every rank calls ``piecewise_backend.release_graphs()`` before ``destroy_process_group()`` (the
README says why).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
import transformers

import piecewise_backend
from benchmarks import hf
from benchmarks.harness import Suite
from toys.parallel import MULTICAST_OFF


def _shared_folder(device: str) -> str:
    """A folder name every rank agrees on (rank 0's, broadcast)."""
    name = [tempfile.mkdtemp(prefix="hf_tp_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(name, src=0)
    return name[0]


def _save_random_model(key: str, folder: str) -> int:
    """Rank 0 writes ``key``'s model (random weights, fixed seed) to ``folder``; its parameter count."""
    params = [0]
    if dist.get_rank() == 0:
        model = hf.build_model(key, "cpu", torch.float32)
        params[0] = sum(p.numel() for p in model.parameters())
        model.save_pretrained(folder)
        model.generation_config.save_pretrained(folder)
    dist.broadcast_object_list(params, src=0)
    return params[0]


def _load(folder: str, dtype: torch.dtype, device: str, tp: bool):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype, **({"tp_plan": "auto"} if tp else {})
    )
    model = (model if tp else model.to(device)).eval()
    model.generation_config.eos_token_id = None  # exactly --tokens tokens
    model.generation_config.pad_token_id = 0
    return model


def _reference_tokens(folder: str, dtype: torch.dtype, device: str, prompts: dict, tokens: int) -> dict:
    """Rank 0: the whole model, one process, eager: the tokens each batch's prompt gives."""
    if dist.get_rank() != 0:
        return {}
    model = _load(folder, dtype, device, tp=False)
    out = {batch: hf.run(model, ids, tokens, {})[0].cpu() for batch, ids in prompts.items()}
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="llama-28L-1.5b")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--variants", nargs="+", default=["eager", "compile-default", "piecewise-static", "piecewise-dynamic"]
    )
    parser.add_argument(
        "--agreement-from",
        help="an fp32 run's JSON: its token_agreement per variant and batch "
        "becomes these rows' (theirs kept as token_agreement_<dtype>)",
    )
    parser.add_argument(
        "--emulate",
        action="store_true",
        help="on CPU: capture and replay emulated graphs (piecewise_backend.emulated_graphs)",
    )
    args = parser.parse_args()
    for name, value in MULTICAST_OFF.items():
        os.environ.setdefault(name, value)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, args.dtype)
    try:
        folder = _shared_folder(device)
        params = _save_random_model(args.model, folder)
        dist.barrier()
        cfg, _, name, layers = hf.model_config(args.model)
        torch.manual_seed(1)  # the same prompts on every rank
        prompts = {b: torch.randint(3, cfg.vocab_size, (b, hf.PROMPT)).to(device) for b in args.batches}
        reference = _reference_tokens(folder, dtype, device, prompts, args.tokens)
        dist.barrier()
        model = _load(folder, dtype, device, tp=True)
        dist.barrier()  # every rank has read the checkpoint (GBs at 1.5e9 parameters): rank 0 removes it
        if rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
        eager_forward = model.forward
        rows, eager_ms = [], {}
        checked = _fp32_rows(args.agreement_from) if rank == 0 and args.agreement_from else None
        base = {
            "model": name,
            "layers": layers,
            "params": params,
            "world": world,
            "dtype": args.dtype,
            "tokens": args.tokens,
            "device": device,
        }
        with piecewise_backend.emulated_graphs(args.emulate and device == "cpu"):  # compiled and first called in it
            for variant in args.variants:
                kwargs = hf.prepare(variant, model, eager_forward)
                for batch, ids in prompts.items():
                    rows.append(
                        _row(
                            {**base, "batch": batch, "variant": variant},
                            model,
                            ids,
                            kwargs,
                            reference.get(batch),
                            eager_ms,
                        )
                    )
                    if checked is not None:
                        _agreement_from(rows[-1], checked)
                    if rank == 0:
                        print(json.dumps(rows[-1]), flush=True)
                        pathlib.Path(args.out).write_text(
                            json.dumps(
                                {"hf": rows, "torch": torch.__version__, "transformers": transformers.__version__},
                                indent=1,
                            )
                            + "\n"
                        )
    finally:
        piecewise_backend.release_graphs()  # NCCL waits for graphs holding its collectives
        dist.destroy_process_group()


def _fp32_rows(path: str) -> dict:
    """An fp32 run's rows by (variant, batch)."""
    return {(r["variant"], r["batch"]): r for r in json.loads(pathlib.Path(path).read_text())["hf"]}


def _agreement_from(row: dict, checked: dict) -> None:
    """The fp32 run's tokens decide ``token_agreement`` (bf16's near-ties of random weights flip)."""
    fp32 = checked.get((row["variant"], row["batch"]), {})
    if "token_agreement" in row:
        row[f"token_agreement_{row['dtype']}"] = row.pop("token_agreement")
    row["token_agreement"] = fp32.get("token_agreement")
    row["token_agreement_dtype"] = fp32.get("dtype")


def _row(row: dict, model, ids, kwargs: dict, reference: torch.Tensor | None, eager_ms: dict) -> dict:
    """One variant at one batch: ms per token, its speed-up over eager TP, and (rank 0) its tokens
    against the whole model's; a row that raises says why (the other rows still run)."""
    start, calls_before = time.perf_counter(), hf.graph_calls()
    try:
        out, ms, _ = hf.measure(model, ids, row["tokens"], kwargs)
    except Exception as exc:
        return {**row, "error": f"{type(exc).__name__}: {exc}"[:800]}
    row.update(seconds=round(time.perf_counter() - start, 1), ms_per_token=round(ms, 3))
    if row["variant"] == "eager":
        eager_ms[row["batch"]] = ms
    if row["batch"] in eager_ms:
        row["speedup_vs_eager"] = round(eager_ms[row["batch"]] / ms, 2)
    if reference is not None:
        row["token_agreement"] = hf.token_agreement(out, reference)
    if "piecewise" in row["variant"]:
        row.update(hf.piecewise_facts(calls_before))
        row["graphs_with_collectives"] = sum(g.agreement is not None for g in piecewise_backend.compiled_graphs())
    return row


def rows(variant: str, args) -> Iterator[dict]:
    """In the suite's child: the ranks under torchrun, then rank 0's rows."""
    out = os.path.join(args.work, f"tp-{variant}.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}", "-m", "benchmarks.tensor_parallel",
           "--out", out, "--model", variant, "--dtype", args.dtype, "--tokens", str(args.tokens),
           "--batches", *args.batches.split(","), "--variants", *args.backends.split(",")]  # fmt: skip
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""} if args.smoke else None
    done = subprocess.run([*cmd, *(["--emulate"] if args.smoke else [])], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"torchrun exited {done.returncode}: {done.stderr[-1500:]}")
    result = json.loads(pathlib.Path(out).read_text())
    for row in result["hf"]:
        yield {**row, "transformers": result["transformers"]}


def options(parser) -> None:
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--backends", default="eager,compile-default,piecewise-static,piecewise-dynamic")


# fmt: off
SUITE = Suite("tensor-parallel", "a Hugging Face model under tp_plan='auto' on two GPUs: tokens against one process, ms a token",
              ("llama-28L-1.5b", "tiny"), rows, options, default=("llama-28L-1.5b",),
              smoke="--variants tiny --dtype float32 --batches 3 --tokens 6 --backends eager,piecewise-static".split())
# fmt: on


if __name__ == "__main__":
    main()
