"""Train a small GPT on the docstrings of Python's standard library, with PyTorch's or
fusednorm's LayerNorm (and feed-forward block), and record the loss curve.

    python examples/train_gpt.py --norm fused --steps 50 --device cpu --seed 0 --out runs/fused
    python examples/train_gpt.py --norm torch --steps 50 --device cpu --seed 0 --out runs/torch
    python examples/compare_runs.py runs/torch runs/fused --out runs/loss_curves.png

With the same seed the two runs start from the same weights and see the same batches, so
their losses differ only by the kernels' rounding. Writes OUT/metrics.json and
OUT/loss_curve.png.

Under torchrun, --tp N runs tensor + sequence parallelism over N processes and --fsdp
FSDP2 over the rest (examples/gpt_parallel.py); the losses are those of one process:

    torchrun --nproc-per-node 2 examples/train_gpt.py --norm fused --tp 2 --out runs/tp2
    torchrun --nproc-per-node 4 examples/train_gpt.py --norm fused --tp 2 --fsdp --out runs/2d
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm import tqdm

from compare_runs import plot_runs
from gpt_model import GPTConfig, build_model
from stdlib_corpus import ByteCorpus, stdlib_docstrings

_EXAMPLES_DIR = Path(__file__).resolve().parent
_REPO = _EXAMPLES_DIR.parent
_CPUINFO = Path("/proc/cpuinfo")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--norm", choices=["torch", "fused"], required=True,
                        help="LayerNorm/FFN implementation")
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--seed", type=int, default=0,
                        help="seeds the weights and the batch order")
    parser.add_argument("--out", type=Path, required=True, help="directory for the results")
    parser.add_argument("--amp", choices=["bf16"], default=None,
                        help="run under torch.autocast with this dtype (default: fp32)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=128, help="context length")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--gelu", choices=["none", "tanh"], default="none",
                        help="the feed-forward block's GELU: exact, or the tanh form GPT-2 uses")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    parser.add_argument("--corpus-bytes", type=int, default=1_000_000,
                        help="size of the docstring corpus")
    parser.add_argument("--threads", type=int, default=0,
                        help="CPU threads for PyTorch (default: PyTorch's choice)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor + sequence parallel size (under torchrun)")
    parser.add_argument("--fsdp", action="store_true",
                        help="FSDP2 over the processes that --tp leaves (under torchrun)")
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "block_size", "n_layer", "n_head", "d_model"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible to this PyTorch")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.tp < 1 or world % args.tp:
        parser.error(f"--tp {args.tp} must divide the number of processes ({world})")
    if world // args.tp > 1 and not args.fsdp:
        parser.error(f"{world} processes for --tp {args.tp}: add --fsdp for the other "
                     f"{world // args.tp}, or run {args.tp} processes")
    if args.batch_size % (world // args.tp):
        parser.error(f"--batch-size {args.batch_size} must be a multiple of the "
                     f"{world // args.tp} FSDP processes")
    return args


def lr_at(step: int, steps: int, peak: float) -> float:
    """Linear warm-up over the first 10% of the steps, then cosine decay to peak / 10."""
    warmup = max(1, steps // 10)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: torch.nn.Module, lr: float, foreach: bool | None = None
                   ) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not on norms, biases)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), foreach=foreach)


def clip_grad_norm(parameters, max_norm: float) -> None:
    """torch.nn.utils.clip_grad_norm_ for parameters that mix plain tensors and DTensors
    (tensor parallelism leaves attention's whole), which its batched norms do not take."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    norms = [torch.linalg.vector_norm(g) for g in grads]
    norms = [n.full_tensor() if isinstance(n, DTensor) else n for n in norms]
    total = torch.linalg.vector_norm(torch.stack(norms))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef)


class Parallel:
    """The processes of a torchrun launch: their meshes (tp, dp) and this one's share of a
    batch. One process: nothing to do."""

    def __init__(self, args: argparse.Namespace, device: torch.device):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.tp, self.dp = args.tp, self.world // args.tp
        self.tp_mesh = self.dp_mesh = None
        if self.world == 1:
            return
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        mesh = init_device_mesh(device.type, (self.dp, self.tp), mesh_dim_names=("dp", "tp"))
        self.tp_mesh = mesh["tp"] if self.tp > 1 else None
        self.dp_mesh = mesh["dp"] if args.fsdp else None

    @property
    def active(self) -> bool:
        return self.world > 1

    def parallelize(self, model: torch.nn.Module) -> torch.nn.Module:
        if not self.active:
            return model
        from gpt_parallel import parallelize_gpt

        return parallelize_gpt(model, self.tp_mesh, self.dp_mesh)

    def share(self, x: torch.Tensor) -> torch.Tensor:
        """This process's part of a batch every process drew alike (FSDP splits it)."""
        if self.dp_mesh is None:
            return x
        return x.chunk(self.dp)[self.dp_mesh.get_local_rank()]

    def mean_loss(self, loss: torch.Tensor) -> float:
        """The whole batch's mean loss: the FSDP processes' means averaged."""
        if self.dp_mesh is not None:
            import torch.distributed as dist

            loss = loss.detach().clone()
            dist.all_reduce(loss, dist.ReduceOp.AVG, group=self.dp_mesh.get_group())
        return loss.item()


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model ('AMD EPYC ...'; platform.processor() says only
    'x86_64' on Linux)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in _CPUINFO.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def peak_memory_mb(device: torch.device) -> tuple[float, str]:
    """(megabytes, what was measured): the CUDA caching allocator's peak on a GPU, the
    process's peak resident set (weights, activations, and the libraries) on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda_max_memory_allocated"
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "cpu_max_rss"


# What a run's code is made of: a change here (tracked or untracked, ignored build outputs
# aside) marks the commit stamp "-dirty"; run folders and examples/results do not count.
_SOURCES = ("fusednorm", "csrc", "setup.py", "examples", ":(exclude)examples/results")


def git_commit(repo: Path = _REPO) -> str | None:
    """HEAD's sha, with "-dirty" when the sources differ from it (as the benchmarks' stamp);
    None outside git."""
    # FUSEDNORM_COMMIT names the sources when their .git is not theirs (a copy sent to a GPU
    # machine carried an older one), as for the benchmarks' stamp.
    if os.environ.get("FUSEDNORM_COMMIT"):
        return os.environ["FUSEDNORM_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo,
                              capture_output=True, text=True, timeout=10)
        status = subprocess.run(["git", "status", "--porcelain", "--", *_SOURCES], cwd=repo,
                                capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    sha = head.stdout.strip()
    if head.returncode or not sha:
        return None
    return sha + ("-dirty" if status.returncode == 0 and status.stdout.strip() else "")


def fusednorm_build() -> dict | None:
    """fusednorm.build_info() where fusednorm was imported (--norm fused), else None."""
    module = sys.modules.get("fusednorm")
    if module is None or not hasattr(module, "build_info"):
        return None
    return module.build_info()


@torch.no_grad()
def evaluate(model, corpus: ByteCorpus, config: GPTConfig, batch_size: int, device,
             autocast, seed: int, batches: int = 8) -> float:
    """Mean loss over `batches` fixed held-out batches."""
    generator = torch.Generator().manual_seed(seed + 1)
    model.eval()
    total = 0.0
    for _ in range(batches):
        x, y = corpus.batch("val", batch_size, config.block_size, generator)
        with autocast():
            _, loss = model(x.to(device), y.to(device))
        total += loss.item()
    model.train()
    return total / batches


class Trainer:
    """One training run the arguments describe, a step at a time: train() runs its steps
    one after another; examples/compare_speed.py --interleave alternates the steps of two
    (one per norm) in one process."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.device = torch.device(args.device)
        if args.threads > 0:
            torch.set_num_threads(args.threads)
        torch.manual_seed(args.seed)
        self.config = GPTConfig(block_size=args.block_size, n_layer=args.n_layer,
                                n_head=args.n_head, d_model=args.d_model, gelu=args.gelu)
        self.corpus = ByteCorpus(stdlib_docstrings(args.corpus_bytes))
        shortest = min(len(self.corpus.train), len(self.corpus.val))  # val: the last tenth
        if shortest <= args.block_size:
            raise SystemExit(
                f"train_gpt.py: error: --corpus-bytes {args.corpus_bytes} leaves "
                f"{shortest} tokens for the held-out split, too few for --block-size "
                f"{args.block_size}: give at least {10 * (args.block_size + 1) + 10} bytes")
        self.parallel = Parallel(args, self.device)
        self.model = self.parallel.parallelize(
            build_model(self.config, args.norm, args.seed, self.device))
        self.step_model = torch.compile(self.model) if args.compile else self.model
        # Tensor parallelism leaves attention's parameters plain tensors among DTensors,
        # which the optimizer's batched (foreach) kernels do not mix.
        self.optimizer = make_optimizer(self.model, args.lr,
                                        foreach=False if self.parallel.active else None)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.generator = torch.Generator().manual_seed(args.seed)
        # Steps before this one (compilation, allocator warm-up) are left out of tokens/s.
        self.first_timed = min(args.steps - 1, max(1, args.steps // 10))
        self.steps_done = 0
        self.losses: list[float] = []
        self.step_seconds: list[float] = []  # wall time of each timed step
        self.start = self.end = 0.0  # the timed steps' first start and last end

    def autocast(self):
        if self.args.amp is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def step(self) -> float | None:
        """Runs the next optimizer step; returns its wall time in seconds if it is timed."""
        step, args, device = self.steps_done, self.args, self.device
        step_start = time.perf_counter()
        if step == self.first_timed:
            self.start = step_start
        x, y = self.corpus.batch("train", args.batch_size, self.config.block_size, self.generator)
        x, y = self.parallel.share(x), self.parallel.share(y)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr)
        with self.autocast():
            _, loss = self.step_model(x, y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.parallel.active:
            clip_grad_norm(list(self.model.parameters()), 1.0)
        else:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.losses.append(self.parallel.mean_loss(loss))  # waits for the step to finish
        self.end = time.perf_counter()
        self.steps_done += 1
        if step < self.first_timed:
            return None
        self.step_seconds.append(self.end - step_start)
        return self.step_seconds[-1]

    def metrics(self) -> dict:
        """The run's metrics (see main()); tokens_per_s is over the wall time from the first
        timed step's start to the last step's end."""
        args, config, model = self.args, self.config, self.model
        tokens_per_step = args.batch_size * config.block_size
        timed_steps = args.steps - self.first_timed
        peak_mb, peak_kind = peak_memory_mb(self.device)
        norm_cls, ffn_cls = type(model.ln_f), type(model.blocks[0].ffn)
        return {
            "norm": args.norm,
            "norm_class": f"{norm_cls.__module__}.{norm_cls.__qualname__}",
            "ffn_class": f"{ffn_cls.__module__}.{ffn_cls.__qualname__}",
            "losses": self.losses,
            "val_loss": evaluate(model, self.corpus, config, args.batch_size, self.device,
                                 self.autocast, args.seed),
            "tokens_per_s": timed_steps * tokens_per_step / (self.end - self.start),
            # The median step's rate: a step that a busy machine slowed down moves it less.
            "median_step_tokens_per_s": tokens_per_step / statistics.median(self.step_seconds),
            "step_ms": [1e3 * s for s in self.step_seconds],
            "timed_steps": timed_steps,
            "peak_mem_mb": peak_mb,
            "peak_mem_kind": peak_kind,
            "config": {
                **config.to_dict(),
                "steps": args.steps, "seed": args.seed, "batch_size": args.batch_size,
                "lr": args.lr, "amp": args.amp or "fp32", "compile": args.compile,
                "corpus_bytes": self.corpus.num_bytes, "corpus_sha256": self.corpus.sha256,
                "parameters": sum(p.numel() for p in model.parameters()),
            },
            "parallel": {"processes": self.parallel.world, "tp": self.parallel.tp,
                         "fsdp": self.parallel.dp_mesh is not None},
            "device": device_name(self.device),
            "device_kind": self.device.type,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "commit": git_commit(),
            # Where fusednorm came from (None when it was not imported: --norm torch).
            "fusednorm_file": getattr(sys.modules.get("fusednorm"), "__file__", None),
            # Its version and build: CPU SIMD level, CUDA archs, a load error (reference path).
            "fusednorm_build": fusednorm_build(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }


def train(args: argparse.Namespace) -> dict:
    """Runs the training the arguments describe and returns the metrics (see main())."""
    trainer = Trainer(args)
    progress = tqdm(range(args.steps), desc=f"{args.norm} {args.device}",
                    disable=args.no_progress or int(os.environ.get("RANK", "0")) > 0,
                    dynamic_ncols=True)
    for _ in progress:
        trainer.step()
        progress.set_postfix(loss=f"{trainer.losses[-1]:.4f}")
    return trainer.metrics()


def main(argv: list[str] | None = None) -> dict:
    """Trains, then writes OUT/metrics.json ({"norm", "losses": per-step floats,
    "tokens_per_s" (timed steps over their elapsed time), "median_step_tokens_per_s",
    "step_ms" (each timed step), "peak_mem_mb", "config", "device", "torch", ...}) and
    OUT/loss_curve.png; returns the metrics."""
    args = parse_args(argv)
    metrics = train(args)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import torch.distributed as dist

        dist.barrier()  # every process done with every collective before any leaves
        dist.destroy_process_group()
        if int(os.environ["RANK"]):
            return metrics  # the same losses as rank 0's: rank 0 writes them
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    plot_runs([metrics], args.out / "loss_curve.png")
    print(
        f"{args.norm}: loss {metrics['losses'][0]:.4f} -> {metrics['losses'][-1]:.4f}, "
        f"val {metrics['val_loss']:.4f}, {metrics['tokens_per_s']:.0f} tokens/s, "
        f"peak {metrics['peak_mem_mb']:.0f} MB ({metrics['peak_mem_kind']}); wrote {args.out}",
        file=sys.stderr,
    )
    return metrics


if __name__ == "__main__":
    main()
