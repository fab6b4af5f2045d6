"""Evaluation on an island of its own (Pathways' heterogeneous programs): `runtime.eval_island`.

The training mesh and the evaluation island are two process meshes running different programs.
At a step due for evaluation the training ranks gather their parameters, whole (one rank per
pipeline stage sends its part: the parameters are replicated over the data and tensor axes once
gathered), the controller forwards them to the island and goes on dispatching training steps;
the island's one process loads them into its own copy of the model (one process, no
parallelism) and computes the held-out loss on the same held-out batches as the in-line
evaluation. Its result lands in metrics.jsonl as a record of its own, tagged with the step whose
weights it evaluated (`"eval": "island"`), whenever it is back.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist
from monarch.actor import Actor, endpoint

from plait.comm.spawn import rank_env
from plait.data import eval_batches, load_corpus
from plait.models.source import build_model
from plait.train import loop
from plait.train.build import build_engine
from plait.train.config import config_from_dict, model_config
from plait.train.sections import CommConfig, ParallelConfig


def one_process(cfg):
    """`cfg` on one process: no parallelism, no ZeRO, no compression (the model and the held-out
    batches are those of the run)."""
    return dataclasses.replace(cfg, parallel=ParallelConfig(dp=1), comm=CommConfig())


class EvalActor(Actor):
    """The evaluation island: one process with the whole model, fed whole parameters."""

    def __init__(self) -> None:
        self.engine = self.mesh = None

    @endpoint
    def setup(self, cfg_dict: dict, port: int, threads: int, tokenizer: str) -> None:
        """Its own one-process group (gloo or NCCL, as a rank's), the model and the held-out
        batches (`tokenizer`: the run's, as the training ranks load it)."""
        cfg = one_process(config_from_dict(cfg_dict))
        rank_env(0, 1, port)
        torch.set_num_threads(threads)
        self.mesh = loop.make_mesh(cfg)
        d, t = cfg.data, cfg.train
        cache = d.cache_dir or None
        corpus = load_corpus(d.corpus, d.held_out_fraction, tokenizer, d.vocab_size, cache, False)
        self.val = eval_batches(corpus.val, model_config(cfg).seq_len, t.global_batch, t.eval_batches)
        self.bf16 = t.bf16
        torch.manual_seed(t.seed)
        self.model = build_model(cfg).to(self.mesh.device)
        self.engine = build_engine(self.model, cfg, self.mesh, Path(cfg.train.run_dir or "."))

    @endpoint
    def evaluate(self, step: int, params: dict[str, torch.Tensor]) -> dict:
        """The held-out loss of `params` (the training run's after `step`, whole, by name)."""
        with torch.no_grad():
            mine = dict(self.model.named_parameters())
            missing = sorted(set(mine) - set(params))
            if missing:
                raise KeyError(f"the weights of step {step} lack {missing[:3]} ({len(missing)} in all)")
            for name, p in mine.items():
                p.copy_(params[name].to(p.device, p.dtype))
        val = loop.evaluate(self.engine, self.val, self.mesh, self.mesh.device, self.bf16)
        return {"step": step, "val_loss": val}

    @endpoint
    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.mesh.close()
            self.engine = None
        if dist.is_initialized():
            dist.destroy_process_group()
