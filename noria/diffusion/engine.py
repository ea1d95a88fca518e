"""The diffusion rollout engine: batched SDE/ODE sampling of a DiT on a background thread.

Threads and data flow (the text engine's shape, ``noria.engine.engine``; the thread, its command
inbox and the request plumbing are the text engine's too, ``noria.engine.thread``)::

    callers (asyncio or threads)             engine thread (the only one touching engine state)
    submit / abort / pause / weights  ──▶ inbox ──▶ drain commands between steps
                                                    batch <= max_running_requests running images
                                                    one denoising step for all of them (one forward)
    callback(ImageOutput)  ◀───────────────────────── images whose last step is done

Continuous batching at step granularity: each running image is at its own step (the DiT takes a
timestep per sample), a new request joins the batch at the next step, a finished one leaves it.
Each step of each image records its latent, the log-probability of its Gaussian transition
(``noria.diffusion.sde``) and the weight version that computed it; a weight update commits between
two steps, so a trajectory may hold several versions, like a text response across a weight update.
``generate_batch`` (``submit_many``) puts all its requests into the batch at one step.

Per-step cost (a full batch must run as tightly as diffusers' own loop, ``noria bench diffusion``):
the batch's inputs (latents, labels, schedules, noise buffer) are stacked once when an image joins
or leaves and carried from step to step, with the numbers of all its SDE steps
(``sde.Transition``), so a step runs six tensor ops beyond the forward; each step appends its batch
tensors, which are written into the images' trajectories once, when the batch ends (one stack, the
log-probabilities of all its steps in one go, one read-back, then the callbacks); on a CPU, each
SDE image's step noise is drawn for the whole batch at once, bit for bit the per-step draws
(:func:`_draw_ahead`); steps run in inference mode. On a CPU the engine thread would share the
cores with the waiting caller's OpenMP team, which libgomp then throttles along with its own (every
parallel op waking a sleeping worker: the DiT ran ~40% slower on the engine thread), so the caller
gives its team back when it submits, and the engine gives its own back when idle
(``noria.openmp``).

Seeds: every request has its own ``torch.Generator`` seeded with ``ImageRequest.seed``; it draws the
initial noise and then, for an SDE image (noise level > 0), each step's noise, in order (an ODE
image draws none: its step would multiply it by 0). So the noise of an image does not depend on
what else is batched or when it arrived. With ``deterministic`` (``engine.deterministic``) the DiT
runs batch-invariant kernels (``noria.diffusion.model.set_exact_numerics``), so the whole trajectory
is bit for bit the same whatever the batch, and equals the trainer's recomputation.

What blocks on what: ``await generate`` until the image is done; ``pause``/``resume``,
``commit_weights``, ``release_memory_occupation`` until the current step ends and the command
has run; staging a weight update copies on the caller's thread while denoising goes on. Pausing
(``retract`` or ``in_place``: the same here, a trajectory keeps its latent and resumes from its
step) stops stepping; the steps after a weight update carry the new version.

Not guaranteed: ``release_memory_occupation`` frees only the weight staging buffers (a DiT keeps
no KV cache); bitwise trajectories across devices or dtypes; classifier-free guidance.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from noria.diffusion import sde
from noria.diffusion.model import cast, latent_shape, load_dit, num_classes, set_exact_numerics, velocity
from noria.diffusion.protocol import ImageOutput, ImageRequest
from noria.engine.thread import EngineThread, check_pause_mode, generate, generate_batch
from noria.engine.weight_updates import WeightUpdates
from noria.process.usage import pad_heap_top


@dataclass(eq=False)  # compared by identity (the engine's lists hold each image once)
class _Image:
    """One request in flight."""

    req: ImageRequest
    callback: Callable[[ImageOutput], None]
    generator: torch.Generator
    sigmas: torch.Tensor
    latents: list[torch.Tensor] = field(default_factory=list)
    """Chunks [k, C, H, W] of its latents so far, on the engine's device: the initial noise, then the
    steps of each batch it ran in (written when that batch ends)."""
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    step: int = 0
    """Steps done (and recorded above)."""
    noise: torch.Tensor | None = None
    """[k, C, H, W]: noise of its next k steps, drawn ahead by a batch that ended before using it (see
    :meth:`_Batch.noise`); its next steps take these first, so its draws stay in order."""


@dataclass
class _Batch:
    """The running images' per-step inputs, stacked once when an image joins or leaves the batch and
    carried from step to step while the batch stays the same (a full batch then costs a plain loop's
    tensor work: no per-image stacking or indexing)."""

    images: list[_Image]
    x: torch.Tensor
    """[B, C, H, W] float32: each image's latest latent."""
    start: torch.Tensor
    """[B, C, H, W]: each image's latent when the batch was stacked."""
    labels: torch.Tensor
    """[B] class labels."""
    level: torch.Tensor
    """[B] SDE noise levels (0: the ODE)."""
    sigmas: list[torch.Tensor]
    """Per step of the batch, each image's noise level [B] at that step."""
    moves: list[sde.Transition] | list[torch.Tensor]
    """Per step of the batch: its :class:`~noria.diffusion.sde.Transition` (columns [B, 1, 1, 1]) when
    an image samples the SDE, else its ``dt`` column (the ODE step). Computed for all the batch's
    steps at once when it is stacked (``transitions``): a step then runs the tensor ops of a plain
    loop's step, and the log-probabilities of all its steps are computed at once when it ends."""
    transitions: sde.Transition | None
    """Every step's transition, [B, until, 1, 1, 1] (``density`` [B, until]); None when all rows are ODE."""
    noise_buffer: torch.Tensor | None
    """[B, C, H, W]: each step's noise, drawn in place (zero in ODE rows); None when all rows are ODE
    or the noise is drawn ahead (``ahead``)."""
    draws: list[tuple[torch.Tensor, _Image]]
    """(row of ``noise_buffer``, its image) for every row that samples the SDE."""
    until: int
    """Steps after which the first of its images is done (the batch then ends)."""
    ahead: torch.Tensor | None = None
    """[B, until, C, H, W]: every step's noise, drawn when the batch was stacked (:func:`_draw_ahead`)."""
    steps: list[tuple[torch.Tensor, torch.Tensor | None, int]] = field(default_factory=list)
    """Per step run: (latents [B, C, H, W], the transition's mean [B, C, H, W] or None for an ODE
    batch, weight version)."""

    @classmethod
    def of(cls, images: list[_Image], device: torch.device) -> _Batch:
        levels = [float(i.req.noise_level) for i in images]
        x = torch.stack([i.latents[-1][-1] for i in images])
        stochastic = [row for row, level in enumerate(levels) if level > 0]
        until = min(i.req.steps - i.step for i in images)
        # each image's levels for the batch's steps, [B, until + 1], and its schedule's stand-in for s = 1
        first = images[0]
        if all(i.sigmas is first.sigmas and i.step == first.step for i in images):  # one schedule, as generate_batch
            sigmas = first.sigmas[first.step : first.step + until + 1].expand(len(images), -1)
            sigma_max = first.sigmas[1].expand(len(images))
        else:
            sigmas = torch.stack([i.sigmas[i.step : i.step + until + 1] for i in images])
            sigma_max = torch.stack([i.sigmas[1] for i in images])
        level = torch.tensor(levels, device=device)
        transitions = None
        if stochastic:
            transitions = sde.transition(sigmas[:, :-1], sigmas[:, 1:], sigma_max[:, None].expand(-1, until),
                                         level[:, None].expand(-1, until), latent_dims=x.dim() - 1)  # fmt: skip
            moves = [sde.Transition(*fields) for fields in zip(*(f.unbind(1) for f in transitions))]
        else:
            moves = (sigmas[:, 1:] - sigmas[:, :-1]).reshape(len(images), until, *([1] * (x.dim() - 1))).unbind(1)
        ahead = _draw_ahead(images, stochastic, x, until)
        buffer = torch.zeros_like(x) if stochastic and ahead is None else None
        return cls(
            images=images, x=x, start=x, labels=torch.tensor([i.req.label for i in images], device=device), level=level,
            sigmas=list(sigmas[:, :-1].unbind(1)), moves=list(moves), transitions=transitions,
            noise_buffer=buffer, draws=[(buffer[row], images[row]) for row in stochastic] if buffer is not None else [],
            until=until, ahead=ahead,
        )  # fmt: skip

    def noise(self) -> torch.Tensor | None:
        """This step's noise [B, C, H, W] from each SDE image's own generator, in its order (zeros
        for ODE rows, whose step ignores it); None when every image samples the ODE. The buffer is
        overwritten by the next step's draws: the step consumes it before."""
        if self.ahead is not None:
            return self.ahead[:, len(self.steps)]
        for row, image in self.draws:
            if image.noise is not None:  # drawn ahead by an earlier batch
                row.copy_(image.noise[0])
                image.noise = image.noise[1:] if len(image.noise) > 1 else None
            else:
                row.normal_(generator=image.generator)  # what torch.randn(shape, generator=generator) draws, in place
        return self.noise_buffer

    def keep_unused_noise(self) -> None:
        """Noise drawn ahead for steps this batch did not run goes back to its images (it ended early:
        an image joined or left), so their next steps use it rather than draw past it."""
        ran = len(self.steps)
        if self.ahead is None or ran == self.until:
            return
        for row, image in enumerate(self.images):
            if self.level[row] > 0:
                unused = self.ahead[row, ran:]
                image.noise = unused.clone() if image.noise is None else torch.cat([unused, image.noise])


class DiffusionEngine:
    """See the module docstring."""

    def __init__(self, model: torch.nn.Module, max_batch: int = 64, deterministic: bool = False,
                 weight_version: int = 0) -> None:
        self.model = set_exact_numerics(model.eval()) if deterministic else model.eval()
        first = next(model.parameters())
        self.device, self.dtype = first.device, first.dtype
        if self.device.type == "cpu":
            pad_heap_top()  # many small forwards: keep the freed activations' pages (noria.process.usage)
        self.max_batch, self.deterministic = max_batch, deterministic
        self.num_classes = num_classes(model)
        self.shape = latent_shape(model)
        self._thread = EngineThread(self._loop, "noria-diffusion-engine", cpu=self.device.type == "cpu")
        self.weights = WeightUpdates(self.model, self.device, self._thread.call, _nothing, _nothing, weight_version)
        """Weight updates (``noria.sync``'s in-process target and the server's weight API call it):
        staged on the caller's thread, committed between two denoising steps."""
        self._waiting: list[_Image] = []
        self._running: list[_Image] = []
        self._batch: _Batch | None = None
        """The running images' stacked inputs; None when an image joined or left since the last step."""
        self._paused = False
        self._stats = {"images": 0, "steps": 0, "image_steps": 0, "seconds": 0.0}
        self._thread.start()

    @classmethod
    def from_path(cls, path: str | Path, engine_cfg: Any, dtype: str = "auto", device: str = "cpu",
                  lora: Any = None, weight_version: int = 0) -> DiffusionEngine:
        """Load a DiT folder in ``dtype`` (``auto``: this machine's); ``lora`` (a ``LoraConfig``)
        injects adapters of that shape, which adapter-only weight updates then fill."""
        from noria import hardware

        dtype = hardware.resolve_dtype(dtype, device)
        model = load_dit(path, getattr(torch, dtype), device)
        if lora is not None and lora.enabled and lora.sync == "adapter":
            from noria.train.lora import apply_lora

            model = cast(apply_lora(model, lora), device, getattr(torch, dtype))
        return cls(model, engine_cfg.max_running_requests, engine_cfg.deterministic, weight_version)

    # ------------------------------------------------------------------------------ requests

    def submit(self, req: ImageRequest, callback: Callable[[ImageOutput], None]) -> str:
        """Queue a request; ``callback`` (on the engine thread) gets its output. Returns the request id."""
        image = self._images([req], [callback])[0]
        self._thread.post(lambda: self._waiting.append(image))
        self._thread.give_back_workers()
        return image.req.rid

    def submit_many(self, requests: list[ImageRequest], callbacks: list[Callable[[ImageOutput], None]]) -> list[str]:
        """``submit`` of several requests in one command: they join the batch at the same step (one
        by one, the engine may start a step with the first few and run the rest one step behind)."""
        images = self._images(requests, callbacks)
        self._thread.post(lambda: self._waiting.extend(images))
        self._thread.give_back_workers()  # after posting them: the engine starts on them meanwhile
        return [image.req.rid for image in images]

    def _images(self, requests: list[ImageRequest], callbacks: list[Callable[[ImageOutput], None]]) -> list[_Image]:
        self._thread.check_accepting()
        return [self._image(req, callback) for req, callback in zip(requests, callbacks, strict=True)]

    def _image(self, req: ImageRequest, callback: Callable[[ImageOutput], None]) -> _Image:
        req.validate(self.num_classes)
        if not req.rid:
            req = replace(req, rid=uuid.uuid4().hex)
        gen = torch.Generator(self.device).manual_seed(req.seed % (1 << 64))
        return _Image(req, callback, gen, _sigmas(req.steps, req.shift, self.device))

    async def generate(self, req: ImageRequest) -> ImageOutput:
        """Generate to completion; cancelling the await aborts the request."""
        return await generate(self.submit, self.abort, req)

    def generate_batch(self, requests: list[ImageRequest], timeout_s: float | None = None) -> list[ImageOutput]:
        """Blocking convenience for scripts, tests and benchmarks: submit all at once, wait for all, in order."""
        return generate_batch(self.submit_many, requests, timeout_s, many=True)

    def abort(self, rid: str, message: str = "aborted by request") -> None:
        """Abort a waiting or running request (its callback gets reason abort); unknown ids are ignored."""
        self._thread.post(lambda: self._abort([i for i in self._waiting + self._running if i.req.rid == rid], message))

    def _abort(self, images: list[_Image], message: str, keep_batch: bool = True) -> None:
        """Abort ``images``; with ``keep_batch``, the steps of the batch's other images are kept first."""
        if keep_batch and self._batch is not None and any(i in self._running for i in images):
            self._end_batch()  # may finish some of them: those are done, not aborted
        for image in images:
            if image in self._waiting or image in self._running:
                (self._waiting if image in self._waiting else self._running).remove(image)
                self._batch = None
                image.callback(ImageOutput(image.req.rid, None, [], [], {"type": "abort", "message": message}))

    def _busy(self) -> bool:
        return bool(self._waiting or self._running)

    def _abort_all(self, message: str) -> None:
        self._thread.post(lambda: self._abort(self._waiting + self._running, message))

    # ------------------------------------------------------------------------------ control

    async def pause(self, mode: str = "retract") -> None:
        """Stop denoising after the current step (both modes keep every trajectory's state)."""
        check_pause_mode(mode)
        await asyncio.wrap_future(self._thread.post_future(lambda: setattr(self, "_paused", True)))

    async def resume(self) -> None:
        await asyncio.wrap_future(self._thread.post_future(lambda: setattr(self, "_paused", False)))

    def release_memory_occupation(self, weights: bool = False) -> None:
        """Pause and free the weight staging buffers (the next update allocates them again); the DiT
        keeps its live weights whatever ``weights`` says."""
        self._thread.call(lambda: setattr(self, "_paused", True))
        self.weights.release()

    def resume_memory_occupation(self) -> None:
        self._thread.call(lambda: setattr(self, "_paused", False))

    def shutdown(self, drain_timeout_s: float = 30.0) -> None:
        """Refuse new requests, let running ones finish for at most ``drain_timeout_s``, abort the rest, stop."""
        self._thread.shutdown(self._busy, lambda: self._abort_all("the engine shut down"), drain_timeout_s)

    @property
    def weight_version(self) -> int:
        """The version the engine serves (its weight component's)."""
        return self.weights.version

    # ------------------------------------------------------------------------------ observability

    def get_load(self) -> dict[str, Any]:
        return {"num_running_reqs": len(self._running), "num_waiting_reqs": len(self._waiting), "kv_usage": 0.0}

    def metrics(self) -> dict[str, Any]:
        s = self._stats
        return {**self.get_load(), **s, "images_per_s": s["images"] / s["seconds"] if s["seconds"] else 0.0,
                "weight_version": self.weight_version}  # fmt: skip

    # ------------------------------------------------------------------------------ engine thread

    def _loop(self) -> None:
        try:
            stepped = False
            while not self._thread.stopping:
                idle = self._paused or not (self._waiting or self._running)
                if idle and stepped:
                    self._thread.give_back_workers(idle=True)
                    stepped = False
                self._thread.drain(block=idle, timeout=0.1)
                if not self._paused and (self._waiting or self._running):
                    self._step()
                    stepped = True
        except BaseException as e:  # noqa: BLE001 -- every waiting caller learns why, then the thread ends
            self._die(e)

    @torch.inference_mode()
    def _step(self) -> None:
        """Admit waiting images up to the batch limit, then one denoising step for the batch."""
        start = time.perf_counter()
        self._admit()
        batch = self._batch
        k = len(batch.steps)
        sigma, move = batch.sigmas[k], batch.moves[k]
        v = velocity(self.model, batch.x, sigma, batch.labels, self.dtype)
        noise = batch.noise()
        if noise is None:  # all ODE: the SDE step with noise level 0 is this, and its log-probabilities are 0
            x_next, mean = sde.ode_step(batch.x, v, move), None
        else:
            x_next, mean = sde.sde_step(batch.x, v, move, noise)
        batch.x = x_next
        batch.steps.append((x_next, mean, self.weight_version))
        # Counted before the batch ends: ending it answers its callers, who may read the metrics at once.
        self._stats["steps"] += 1
        self._stats["image_steps"] += len(batch.images)
        self._stats["seconds"] += time.perf_counter() - start
        if len(batch.steps) == batch.until:
            self._end_batch()

    def _admit(self) -> None:
        """Move waiting images into the batch (each draws its initial noise); a batch whose images
        changed ends and the next one is stacked."""
        while self._waiting and len(self._running) < self.max_batch:
            self._end_batch()
            image = self._waiting.pop(0)
            image.latents.append(torch.randn((1, *self.shape), generator=image.generator, device=self.device))
            self._running.append(image)
        if self._batch is None:
            self._batch = _Batch.of(list(self._running), self.device)

    def _end_batch(self) -> None:
        """Write the batch's steps into its images' trajectories (one stack; the log-probabilities of all
        its steps at once, one read-back) and hand the finished images back; the next step stacks a
        new batch."""
        batch, self._batch = self._batch, None
        if batch is None:
            return
        batch.keep_unused_noise()
        if not batch.steps:
            return
        with torch.inference_mode(False):  # ordinary tensors: an image's chunk may be what its caller gets
            latents = torch.stack([batch.start] + [x for x, _, _ in batch.steps], dim=1)  # [B, 1 + S, C, H, W]
        versions = [version for _, _, version in batch.steps]
        if batch.transitions is None:
            logprobs = [[0.0] * len(versions)] * len(batch.images)
        else:
            ran = sde.Transition(*(f[:, : len(versions)] for f in batch.transitions))
            means = torch.stack([mean for _, mean, _ in batch.steps], dim=1)
            logprobs = sde.transition_logprob(latents[:, 1:], means, ran).tolist()
        done = []
        for row, image in enumerate(batch.images):
            if image.step == 0:  # its first batch started from its initial noise: one chunk holds all its latents
                image.latents[:] = [latents[row]]
            else:
                image.latents.append(latents[row, 1:])
            image.logprobs += logprobs[row]
            image.versions += versions
            image.step += len(versions)
            if image.step == image.req.steps:
                done.append((image, self._output(image)))
        # The callbacks come after all the tensor work: the first one wakes a waiting caller, and a torch
        # op between two callbacks would then hand the GIL back and forth with it.
        for image, _ in done:
            self._running.remove(image)
        self._stats["images"] += len(done)
        for image, out in done:
            image.callback(out)

    @staticmethod
    def _output(image: _Image) -> ImageOutput:
        if len(image.latents) == 1:  # it ran in one batch (written outside inference mode, see _end_batch)
            latents = image.latents[0]
        else:
            with torch.inference_mode(False):  # an ordinary tensor for the caller
                latents = torch.cat(image.latents)
        if latents.device.type != "cpu" or latents.dtype != torch.float32:
            latents = latents.float().cpu()
        return ImageOutput(image.req.rid, latents, image.logprobs, image.versions)

    def _die(self, error: BaseException) -> None:
        self._thread.fail(error)  # queued submits join the waiting images first, so they are aborted too
        self._abort(self._waiting + self._running, f"the diffusion engine died: {type(error).__name__}: {error}", keep_batch=False)


AHEAD_MAX_ELEMENTS = 1 << 22
"""Largest noise block (elements, float32: 16 MB) a batch draws ahead (:func:`_draw_ahead`)."""


def _draw_ahead(images: list[_Image], stochastic: list[int], x: torch.Tensor, until: int) -> torch.Tensor | None:
    """Every step's noise of a batch [B, until, C, H, W] (zeros in ODE rows), each SDE image's rows in
    one draw from its generator; None where that would not be bit for bit what one draw per step gives.

    Why: one ``normal_`` call per SDE image per step cost about 2.5 us each on a 2-core AMD EPYC, 1.2%
    of a 64-image step of the digits DiT, where diffusers' loop draws nothing per step. Equal bit for
    bit: torch's CPU ``normal_`` of n >= 16 float32 values draws n uniforms in order and transforms
    them 16 at a time (Box-Muller on pairs 8 apart), redrawing the last 16 when 16 does not divide n;
    so k draws of a latent of n values, 16 | n, are one draw of k * n values. Not on CUDA (Philox
    offsets advance per call), not for latents of other sizes, and not above ``AHEAD_MAX_ELEMENTS``:
    those draw per step."""
    per_step = x[0].numel()
    if (not stochastic or x.device.type != "cpu" or x.dtype != torch.float32 or per_step < 16 or per_step % 16
            or len(images) * until * per_step > AHEAD_MAX_ELEMENTS):  # fmt: skip
        return None
    shape = (len(images), until, *x.shape[1:])
    ahead = torch.empty(shape) if len(stochastic) == len(images) else torch.zeros(shape)
    for row in stochastic:
        image = images[row]
        if image.noise is None:  # nothing drawn ahead before: the usual case, one draw
            ahead[row].normal_(generator=image.generator)
            continue
        kept = image.noise[:until]
        ahead[row, : len(kept)] = kept
        image.noise = image.noise[until:] if len(image.noise) > until else None
        if len(kept) < until:
            ahead[row, len(kept):].normal_(generator=image.generator)
    return ahead


def _nothing() -> None:
    """A DiT has no derived weights to refresh and no cache to flush after a commit."""


@functools.lru_cache(maxsize=64)
def _sigmas(steps: int, shift: float, device: torch.device) -> torch.Tensor:
    """One schedule tensor per (steps, shift, device), shared by every image that samples it (read only)."""
    return sde.flow_sigmas(steps, shift).to(device)
