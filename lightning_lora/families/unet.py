"""What SDXL and SD1.5 share: a ``UNet2DConditionModel`` trained as a discrete DDPM on 4-channel VAE latents.

Shapes, for an image of ``H x W`` pixels and a batch ``B``:

* The VAE downsamples by 8 into 4 channels: latents ``[B, 4, H/8, W/8]``, normalized as ``z * scaling_factor``
  (0.18215 for SD1.x, 0.13025 for SDXL; no shift).
* The UNet takes the noisy latents, an integer timestep ``t`` in ``[0, T)`` (T = 1000) and the text embeddings as
  cross-attention context ``encoder_hidden_states [B, 77, D]``, and predicts the noise (``epsilon``) or the velocity
  (``v_prediction``) with the latents' shape. SDXL adds ``added_cond_kwargs`` (see :mod:`.sdxl`).

The noise schedule (betas, T) and the prediction type are properties of the *model*, read from its
``scheduler/scheduler_config.json``; the prediction type can be overridden (to train a v-prediction model from an
epsilon one, say), and so can the schedule's terminal SNR. :meth:`UNetFamily.load_denoiser` attaches the resolved
:class:`NoiseSchedule` to the UNet it returns (``unet.noise_schedule``), so that :meth:`UNetFamily.loss` always uses
the schedule of the model it trains. The math is in :mod:`lightning_lora.objectives`.

LoRA targets (``model.lora.targets``) are presets over diffusers module names:

* ``attention``: ``to_q, to_k, to_v, to_out.0`` of every self- and cross-attention (the diffusers scripts' set);
* ``attention_ff``: everything inside the transformer blocks: also the feed-forward (``ff.net.0.proj``,
  ``ff.net.2``) and ``proj_in`` / ``proj_out`` (kohya's default "LierLa" set);
* ``locon``: ``attention_ff`` plus the convolutions of the ResNets (``conv1``, ``conv2``, ``conv_shortcut``, and their
  ``time_emb_proj``) and of the down/upsamplers: kohya's LoRA-C3Lier / LyCORIS LoCon. A 3x3 convolution gets a 3x3
  ``lora_A`` (``[r, in, 3, 3]``) and a 1x1 ``lora_B`` (``[out, r, 1, 1]``), as in kohya's files.

LoRA files: the diffusers layout (``unet.<module>``) loads in diffusers, and in ComfyUI without its attention layers
(ComfyUI maps diffusers-named attention layers only in an older spelling); the kohya layout (sd-scripts' names: SDXL's
the original SGM UNet's, :mod:`lightning_lora.formats.ldm`; SD1.x's the diffusers ones with ``_``) loads in ComfyUI,
Forge/A1111, sd-scripts and diffusers. :meth:`UNetFamily.lora_coverage` says which layers each tool applies.

Only the UNet gets LoRA. Text-encoder LoRA is deliberately not offered: the text embeddings are computed once into
the cache, so a text-encoder adapter would never see a gradient (kohya's ``network_train_unet_only``).
"""

from __future__ import annotations

import inspect
import re
from abc import abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from typing_extensions import override

from lightning_lora import objectives
from lightning_lora.errors import ConfigError
from lightning_lora.families.base import (
    DiffusersModel,
    DiffusionFamily,
    ModelSource,
    compute_dtype,
    load_component,
)
from lightning_lora.families.facts import Architecture, Compiling, Planning
from lightning_lora.formats.clients import COMFY_DORA, COMFY_PEFT_DORA, DIFFUSERS_DORA, Coverage
from lightning_lora.objectives import PredictionType

__all__ = ["NoiseSchedule", "UNetFamily", "cross_attention_widths", "noise_schedule_of"]

_ATTENTION = r"attn[12]\.(to_q|to_k|to_v|to_out\.0)"
_TRANSFORMER = rf"attentions\.\d+\.(proj_in|proj_out|transformer_blocks\.\d+\.({_ATTENTION}|ff\.net\.(0\.proj|2)))"
# What sd-scripts' networks/lora.py makes no LoRA modules for, and ComfyUI's diffusers-named attention layers.
_OUTSIDE_BLOCKS = re.compile(r"^(conv_in|conv_out|time_embedding\..+|add_embedding\..+|class_embedding\..+)$")
_ATTENTION_LAYER = re.compile(r"\.to_(q|k|v|out\.0)$")
_CONV = r"resnets\.\d+\.(conv1|conv2|conv_shortcut|time_emb_proj)|(downsamplers|upsamplers)\.0\.conv"


@dataclass(frozen=True)
class NoiseSchedule:
    """The discrete noise schedule a UNet was trained with, and what it predicts."""

    alphas_cumprod: torch.Tensor
    """``alpha_bar_t`` for ``t = 0 .. T-1``, float32 on the CPU."""
    prediction_type: PredictionType

    @property
    def num_train_timesteps(self) -> int:
        return int(self.alphas_cumprod.shape[0])


def cross_attention_widths(tensors: Mapping[str, torch.Tensor]) -> set[int]:
    """The input widths of the cross-attention keys (``attn2.to_k``) adapted in a LoRA file: the text encoder's width,
    which tells the UNet families apart (SD1.x 768, SD2.x 1024, SDXL 2048)."""
    return {
        int(t.shape[1])
        for k, t in tensors.items()
        if "attn2" in k and "to_k" in k and k.endswith(("lora_A.weight", "lora_down.weight"))
    }


def noise_schedule_of(denoiser: DiffusersModel) -> NoiseSchedule:
    """The :class:`NoiseSchedule` that :meth:`UNetFamily.load_denoiser` attached to ``denoiser``."""
    schedule = getattr(denoiser, "noise_schedule", None)
    if not isinstance(schedule, NoiseSchedule):
        raise RuntimeError("this UNet has no noise schedule attached: load it with the family's load_denoiser()")
    return schedule


class UNetFamily(DiffusionFamily):
    """Options shared by the UNet families (:class:`~lightning_lora.families.SDXL`, ``SD15``).

    Args:
        prediction_type: what the UNet predicts; null reads it from the model's scheduler config (``epsilon`` for
            SD1.5 and SDXL base, ``v_prediction`` for SD2-768 and v-pred fine-tunes). Setting it to the other value
            trains the model towards that objective.
        noise_offset: add ``noise_offset * N(0, 1)`` per sample and channel to the training noise (0.05 to 0.1 lets
            the model learn very dark and very bright images); 0 disables it. Applied in training steps only, not in
            the fixed evaluation loss.
        min_snr_gamma: weight each sample's loss by min-SNR-gamma (5.0 is the paper's value); null disables it.
        zero_terminal_snr: rescale the noise schedule so the last timestep is pure noise (Lin et al. 2023). Needs
            v-prediction. Sampling then uses a zero-SNR, "trailing" scheduler; use the same at inference.
        min_timestep: train on timesteps ``>= min_timestep`` only.
        max_timestep: train on timesteps ``< max_timestep`` only; null means the schedule's length (1000).
        clip_skip: use the text encoder's hidden state this many layers before the one the model normally uses;
            null is the model's default. diffusers' convention: 1 is what A1111 and kohya call "clip skip 2" (common
            for anime SD1.5 models). Changes the cached embeddings; pass the same ``clip_skip`` at inference.
    """

    # ``model.compile_blocks`` compiles the transformer blocks alone (``compiling.regions`` stays empty): compiled,
    # the ResNets add 12-14 graphs to the blocks' 3, each traced again at every start, and they did not make the step
    # faster where it was measured. On an H100, transformer blocks alone against ResNets compiled too: SD1.5
    # (sd15_8gb, 512²) 0.118 against 0.129 s a step, first step 28.6 against 91.5 s cold; SDXL (sdxl_24gb, 1024²) 0.209
    # against 0.210-0.218 s, first step 15.8 against 61.5 s cold, a second start 20.0 against 24.5 s to the first step
    # (eager: 16.8). The ResNets compiled kept less memory: 0.4 GiB (SD1.5) and 0.7 GiB (SDXL, 9.65 against 10.34)
    # less. Both steps were the host's; on a smaller GPU, where the GPU is the limit, fusing the ResNets' norms saves an
    # estimated 1-2% of an SDXL step (their elementwise traffic). ``tools/bench.py --compile-regions ResnetBlock2D``
    # measures them compiled (BENCHMARKS.md, "What each option measured"). diffusers' checkpointing of a UNet also
    # recomputes its ResNets, which are no repeated blocks. Each UNet family adds its ``stream_sources``.
    compiling: ClassVar[Compiling] = Compiling(checkpoints_only_repeated_blocks=False)
    architecture: ClassVar[Architecture] = Architecture(
        pipeline_classes=(),  # each UNet family names its pipeline and text encoders
        denoiser_class="UNet2DConditionModel",
        denoiser_subfolder="unet",
        text_encoders=(),
        latent_divisor=8,
        lora_presets={
            "attention": rf".*attentions\.\d+\.transformer_blocks\.\d+\.{_ATTENTION}",
            "attention_ff": rf".*{_TRANSFORMER}",
            "locon": rf".*({_TRANSFORMER}|{_CONV})",
        },
    )
    # The whole forward's share of the eager count with the transformer blocks compiled and the ResNets eager, for SDXL:
    # sdxl_24gb (rank 32, 1024², batch 1) planned 10.31 GiB against 10.34 measured (an H100). SD1.5 has its own. Each
    # UNet family adds its known models and VAE.
    planning: ClassVar[Planning] = Planning(
        sampling_batch=2,  # classifier-free guidance: the prompt and the negative in one batch
        compiled_saved_fraction=0.60,
    )
    vae_scale_factor: ClassVar[int] = 8
    """The VAE's downscale: latents are ``[B, 4, H/8, W/8]``."""

    def __init__(
        self,
        prediction_type: PredictionType | None = None,
        noise_offset: float = 0.0,
        min_snr_gamma: float | None = None,
        zero_terminal_snr: bool = False,
        min_timestep: int = 0,
        max_timestep: int | None = None,
        clip_skip: int | None = None,
    ) -> None:
        option = "model.family.init_args"
        if noise_offset < 0:
            raise ConfigError(f"{option}.noise_offset: {noise_offset} must be >= 0 (typical: 0.05 to 0.1).")
        if min_snr_gamma is not None and min_snr_gamma <= 0:
            raise ConfigError(f"{option}.min_snr_gamma: {min_snr_gamma} must be positive (typical: 5.0), or null.")
        if min_timestep < 0 or (max_timestep is not None and max_timestep <= min_timestep):
            raise ConfigError(
                f"{option}.min_timestep/max_timestep: [{min_timestep}, {max_timestep}) is not a timestep range; use "
                "0 <= min_timestep < max_timestep <= 1000."
            )
        if clip_skip is not None and clip_skip < 1:
            raise ConfigError(f"{option}.clip_skip: {clip_skip} must be at least 1, or null for the model's default.")
        if zero_terminal_snr and prediction_type == "epsilon":
            raise ConfigError(_ZTSNR_NEEDS_V)
        self.prediction_type = prediction_type
        self.noise_offset = noise_offset
        self.min_snr_gamma = min_snr_gamma
        self.zero_terminal_snr = zero_terminal_snr
        self.min_timestep = min_timestep
        self.max_timestep = max_timestep
        self.clip_skip = clip_skip

    # -- loading -----------------------------------------------------------------------------------------------
    def check_source(self, source: ModelSource) -> None:
        super().check_source(source)
        if source.is_local:  # a small local JSON: the options are checked against the model before any heavy work
            self.noise_schedule(source)

    def scheduler_config(self, source: ModelSource) -> dict[str, Any]:
        """The model's ``scheduler/scheduler_config.json`` (a small file; no weights are read)."""
        from diffusers import DDPMScheduler  # any scheduler class reads any scheduler_config.json

        return dict(load_component(DDPMScheduler.load_config, source, "scheduler"))

    def noise_schedule(self, source: ModelSource) -> NoiseSchedule:
        """The training schedule: the model's betas (rescaled to zero terminal SNR if asked) and prediction type."""
        config = self.scheduler_config(source)
        prediction = self.prediction_type or config.get("prediction_type", "epsilon")
        if prediction not in ("epsilon", "v_prediction"):
            raise ConfigError(
                f"model.pretrained: the scheduler predicts {prediction!r}, which is not supported; set "
                "model.family.init_args.prediction_type to epsilon or v_prediction."
            )
        if self.zero_terminal_snr and prediction == "epsilon":
            raise ConfigError(_ZTSNR_NEEDS_V)
        if config.get("trained_betas") is not None:
            betas = torch.tensor(config["trained_betas"], dtype=torch.float32)
        else:
            betas = objectives.beta_schedule(
                config.get("beta_schedule", "linear"),
                int(config.get("num_train_timesteps", 1000)),
                float(config.get("beta_start", 0.0001)),
                float(config.get("beta_end", 0.02)),
            )
        if self.zero_terminal_snr:
            betas = objectives.rescale_zero_terminal_snr(betas)
        schedule = NoiseSchedule(objectives.alphas_cumprod(betas), prediction)
        if self.max_timestep is not None and self.max_timestep > schedule.num_train_timesteps:
            raise ConfigError(
                f"model.family.init_args.max_timestep: {self.max_timestep} is beyond the model's "
                f"{schedule.num_train_timesteps} timesteps."
            )
        return schedule

    def load_denoiser(self, source: ModelSource) -> nn.Module:
        from diffusers import UNet2DConditionModel

        schedule = self.noise_schedule(source)  # first: a bad scheduler option fails before the big load
        # A single file may use the original (LDM/SGM) names (the UNet part of a full checkpoint is picked out) or
        # diffusers names.
        unet: Any = self.load_denoiser_weights(UNet2DConditionModel, source)
        unet.noise_schedule = schedule
        return unet

    # -- encoding ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_images(self, vae: DiffusersModel, pixels: torch.Tensor) -> torch.Tensor:
        if vae.dtype == torch.float16 and getattr(vae.config, "force_upcast", False):
            vae = vae.float()  # the SDXL VAE overflows in fp16 (its config says so)
        posterior = vae.encode(pixels.to(device=vae.device, dtype=vae.dtype)).latent_dist
        z = posterior.mode()  # the mean: deterministic, so a content-hashed cache entry has one right value
        shift = getattr(vae.config, "shift_factor", None) or 0.0
        return ((z - shift) * vae.config.scaling_factor).float()

    def _clip_tag(self) -> str:
        return f"clip77-skip{self.clip_skip or 0}"

    # -- training ----------------------------------------------------------------------------------------------
    def sample_timesteps(self, latents: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Uniform draws in [0, 1), one per sample; :meth:`loss` maps them onto the model's integer timesteps."""
        return torch.rand(latents.shape[0], generator=generator)

    @override
    def sample_noise(self, latents: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Gaussian noise, plus ``noise_offset`` times one Gaussian draw per sample and channel when set (training
        noise only: the fixed evaluation losses use plain noise)."""
        noise = super().sample_noise(latents, generator)
        if not self.noise_offset:
            return noise
        per_channel = torch.randn(*latents.shape[:2], 1, 1, generator=generator, device=noise.device)
        return objectives.offset_noise(noise, self.noise_offset, per_channel)

    @abstractmethod
    def unet_conditions(
        self, batch: dict[str, torch.Tensor], latents: torch.Tensor, dtype: torch.dtype
    ) -> dict[str, Any]:
        """The UNet's conditioning keyword arguments for a batch (``encoder_hidden_states``, ...)."""

    def predict(
        self, denoiser: DiffusersModel, batch: dict[str, torch.Tensor], noise: torch.Tensor, timesteps: torch.Tensor
    ) -> objectives.Prediction:
        schedule = noise_schedule_of(denoiser)
        x0 = batch["latents"].float()
        noise = noise.float()
        t = objectives.discrete_timesteps(
            timesteps, schedule.num_train_timesteps, self.min_timestep, self.max_timestep
        ).to(x0.device)
        dtype = compute_dtype(denoiser)
        noisy = objectives.ddpm_noisy(x0, noise, schedule.alphas_cumprod, t)
        prediction = denoiser(noisy.to(dtype), t, **self.unet_conditions(batch, x0, dtype), return_dict=False)[0]
        target = objectives.ddpm_target(x0, noise, schedule.alphas_cumprod, t, schedule.prediction_type)
        if self.min_snr_gamma is None:
            return objectives.Prediction(prediction, target)
        snr = objectives.snr(schedule.alphas_cumprod, t)
        weights = objectives.min_snr_weights(snr, self.min_snr_gamma, schedule.prediction_type)
        return objectives.Prediction(prediction, target, weights)

    # -- sampling ----------------------------------------------------------------------------------------------
    def sampling_scheduler(self, source: ModelSource) -> Any:
        """The model's own inference scheduler (what ``from_pretrained`` gives), adjusted to the training options."""
        import diffusers

        config = self.scheduler_config(source)
        cls = getattr(diffusers, config.get("_class_name", "EulerDiscreteScheduler"))
        overrides: dict[str, Any] = {}
        if self.prediction_type is not None:
            overrides["prediction_type"] = self.prediction_type
        if self.zero_terminal_snr:
            if "rescale_betas_zero_snr" not in inspect.signature(cls.__init__).parameters:
                cls = diffusers.DDIMScheduler  # e.g. PNDM cannot: DDIM can, with the same betas
            overrides.update(rescale_betas_zero_snr=True, timestep_spacing="trailing")
        return cls.from_config(config, **overrides)

    # -- interop: what ComfyUI, diffusers and sd-scripts make of a UNet LoRA file (lightning_lora.formats.clients) --
    @override
    def lora_coverage(self, format: str, variants: Mapping[str, str]) -> Coverage:
        c = Coverage()
        modules = list(variants)
        dora = [m for m, v in variants.items() if v == "DoRA"]
        lycoris = [m for m, v in variants.items() if v in ("LoKr", "LoHa")]
        if format == "diffusers":
            c.skip(
                "ComfyUI",
                [m for m in modules if _ATTENTION_LAYER.search(m)],
                "ComfyUI maps diffusers attention layers only in the old '.processor.to_q' spelling",
            )
            c.approx("ComfyUI", dora, COMFY_PEFT_DORA)
            c.skip("kohya", modules, "sd-scripts reads lora_unet_<module> keys, not diffusers/peft keys")
            return c
        c.skip("diffusers", lycoris, "diffusers' kohya converter reads lora_down/lora_up only")
        c.approx("diffusers", dora, DIFFUSERS_DORA)
        c.approx("ComfyUI", dora, COMFY_DORA)
        plain = [m for m, v in variants.items() if v == "LoRA"]  # DoRA/LoKr/LoHa load through LyCORIS: every module
        c.skip(
            "kohya",
            [m for m in plain if _OUTSIDE_BLOCKS.match(m)],
            "networks/lora.py makes LoRA modules inside the transformer, ResNet and resampler blocks only",
        )
        return c

    # -- memory planning ---------------------------------------------------------------------------------------
    def example_inputs(
        self, model: DiffusersModel, batch: int, height: int, width: int, text_len: int, device: str, dtype: torch.dtype
    ) -> dict[str, Any]:
        c = model.config
        f = self.vae_scale_factor
        inputs: dict[str, Any] = {
            "sample": torch.empty(batch, c.in_channels, height // f, width // f, device=device, dtype=dtype),
            "timestep": torch.zeros(batch, device=device, dtype=torch.long),
            "encoder_hidden_states": torch.empty(batch, 77, c.cross_attention_dim, device=device, dtype=dtype),
            "return_dict": False,
        }
        if c.addition_embed_type == "text_time":
            pooled = c.projection_class_embeddings_input_dim - 6 * c.addition_time_embed_dim
            inputs["added_cond_kwargs"] = {
                "text_embeds": torch.empty(batch, pooled, device=device, dtype=dtype),
                "time_ids": torch.empty(batch, 6, device=device, dtype=dtype),
            }
        return inputs

    def block_count(self, model: DiffusersModel) -> int:
        blocks = [*model.down_blocks, model.mid_block, *model.up_blocks]
        return sum(len(b.resnets) + len(getattr(b, "attentions", None) or []) for b in blocks if b is not None)

    def sampling_bytes(self, model: DiffusersModel, height: int, width: int, text_len: int) -> float:
        # Classifier-free guidance doubles the batch; the widest UNet activations are at full latent resolution
        # (320 channels x a few buffers), and the VAE decode at full resolution (128 channels, fp16/bf16).
        latent = (height // self.vae_scale_factor) * (width // self.vae_scale_factor)
        unet = 2 * latent * model.config.block_out_channels[0] * 2 * 8
        vae = height * width * 128 * 2 * 4
        return float(unet + vae + 84e6 * 2)

    @staticmethod
    def _require_negative(negative: dict[str, torch.Tensor] | None, guidance_scale: float) -> None:
        if negative is None and guidance_scale > 1:
            raise ValueError(
                "classifier-free guidance (guidance_scale > 1) needs the empty prompt's embeddings as `negative`"
            )


_ZTSNR_NEEDS_V = (
    "model.family.init_args.zero_terminal_snr: the last timestep of a zero-terminal-SNR schedule is pure noise, where "
    "an epsilon-prediction model has nothing to learn; set model.family.init_args.prediction_type: v_prediction."
)
