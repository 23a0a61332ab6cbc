"""Vision sweep: every timm architecture family, every torchvision model and the diffusers UNet/DiT families,
each predicted by tracer (--target cpu, eager policy) and measured in a real CPU step, with wild.py's table,
rules and summary line.

    python benchmarks/wild_vision.py [--only NAME,...] [--limit N] [--json PATH] [--time-limit S]

Names:
- `timm:<model>`: for each module of `timm.list_modules()` (an architecture family: resnet, vision_transformer,
  convnext, ...), the variant with the fewest parameters, built with `num_classes=10`;
- `tv:<model>`: every model of `torchvision.models.list_models()` (classification, quantizable classification
  built unquantized, segmentation, detection, video, optical flow), with 10 classes where the builder takes
  them;
- `diffusers:<class>`: a UNet or DiT class of diffusers, built from a tiny config (`DIFFUSERS`) and trained
  as a noise predictor (mean squared error against a target of the output's shape).

Images are 64 x 64 where the model runs at that size (timm's ViT-style models are built with `img_size=64`);
else the model's own default input size. Each row is one model under wild.py's `run_one`: the real model
must first run one real forward and backward at the chosen size, then the prediction (AdamW, steady step)
is compared with a real CPU step. Models over MAX_PARAMETERS are skipped (a real CPU step of one is too slow
for the sweep), and the row says so.

torchvision's C++ operators (nms, roi_align, ...) come in a library built against one torch. Where it does
not load beside this torch (PyPI serves a CUDA-built torchvision for torch 2.13; a CPU-only machine that
cannot reach PyTorch's own index has only that), `import torchvision` fails as it registers fake kernels
for `torchvision::nms` and `torchvision::qnms`. The sweep then defines those two operator schemas, without
kernels, before importing torchvision, so that its Python models import; a model that calls a torchvision
C++ operator (the detection models' nms and roi_align) fails in its real run at that operator, and its row
is skipped with that reason: it is not a model this machine can step. With a torchvision that loads its
operators nothing is defined.
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import sys
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from wild import BATCH, DefaultConfigBroken, TimeLimit, _one_line, sweep  # noqa: E402

from tracer.capture.build import StepModule  # noqa: E402
from tracer.capture.model_input import ModelSource  # noqa: E402

IMAGE_SIZE = 64                       # pixels a side, where the model runs at it
CLASSES = 10
VIDEO_FRAMES = 4
MAX_PARAMETERS = 140_000_000          # a real CPU step (AdamW) of a larger model is too slow for the sweep


class NotSteppableHere(DefaultConfigBroken):
    """The real model cannot run on this machine (a torchvision C++ operator with no kernel here)."""
    status = "skipped (no kernel here)"
    why = "a torchvision C++ operator has no kernel beside this torch"


class TooLarge(DefaultConfigBroken):
    """Over MAX_PARAMETERS: a real CPU step is too slow for the sweep."""
    status = "skipped (size)"
    why = f"over {MAX_PARAMETERS:,} parameters"


SKIPS = (NotSteppableHere, TooLarge)
_OPERATOR_SCHEMAS = None              # the schemas this process defined for torchvision, kept alive


def make_torchvision_importable() -> bool:
    """Defines torchvision::nms and torchvision::qnms (schemas only) when torchvision's C++ library does not
    load beside this torch; True when it did so. See the module docstring."""
    global _OPERATOR_SCHEMAS
    spec = importlib.util.find_spec("torchvision")
    if spec is None or _OPERATOR_SCHEMAS is not None:
        return False
    libraries = glob.glob(os.path.join(spec.submodule_search_locations[0], "_C*.so"))
    try:
        for library in libraries:
            torch.ops.load_library(library)
        if libraries:
            return False
    except (OSError, RuntimeError):
        pass
    _OPERATOR_SCHEMAS = torch.library.Library("torchvision", "DEF")
    for name in ("nms", "qnms"):
        _OPERATOR_SCHEMAS.define(f"{name}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    return True


# ---- what a model is trained on -------------------------------------------------------------------------

def classification_batch(size: int):
    return lambda batch, seq: (torch.randn(batch, 3, size, size), torch.randint(0, CLASSES, (batch,)))


def video_batch(size: int, frames: int = VIDEO_FRAMES):
    return lambda batch, seq: (torch.randn(batch, 3, frames, size, size), torch.randint(0, CLASSES, (batch,)))


def classification_loss(out, labels):
    """Cross-entropy on the logits; torchvision's GoogLeNet and Inception v3 return their auxiliary logits
    too in training, which their reference recipe adds at weight 0.3 and 0.4."""
    if isinstance(out, tuple) and hasattr(out, "_fields"):
        weights = {"aux_logits2": 0.3, "aux_logits1": 0.3, "aux_logits": 0.4}
        return F.cross_entropy(out.logits, labels) + sum(
            weights[f] * F.cross_entropy(getattr(out, f), labels) for f in out._fields
            if f != "logits" and getattr(out, f) is not None)
    return F.cross_entropy(out, labels)


def segmentation_batch(size: int):
    return lambda batch, seq: (torch.randn(batch, 3, size, size), torch.randint(0, CLASSES, (batch, size, size)))


def segmentation_loss(out, mask):
    """torchvision's segmentation recipe: cross-entropy on "out", plus 0.5 x on "aux" where the model has it."""
    loss = F.cross_entropy(out["out"], mask)
    return loss + 0.5 * F.cross_entropy(out["aux"], mask) if "aux" in out else loss


def flow_batch(size: int):
    return lambda batch, seq: (torch.randn(batch, 3, size, size), torch.randn(batch, 3, size, size),
                               torch.randn(batch, 2, size, size))


def flow_loss(predictions, flow):
    """RAFT's sequence loss: the L1 error of every refinement, weighted 0.8 ** (distance from the last)."""
    n = len(predictions)
    return sum(0.8 ** (n - i - 1) * (p - flow).abs().mean() for i, p in enumerate(predictions))


def detection_batch(size: int, masks: bool = False, keypoints: bool = False):
    def batch_of(batch, seq):
        images = [torch.rand(3, size, size) for _ in range(batch)]
        targets = []
        for _ in range(batch):
            target = {"boxes": torch.tensor([[4.0, 4.0, size / 2, size / 2]]), "labels": torch.tensor([1])}
            if masks:
                target["masks"] = torch.zeros(1, size, size, dtype=torch.uint8)
            if keypoints:
                target["keypoints"] = torch.tensor([[[8.0, 8.0, 1.0]] * 17])
            targets.append(target)
        return images, targets, None
    return batch_of


def detection_loss(losses, _):
    return sum(losses.values())


# ---- the model sources --------------------------------------------------------------------------------

def _source(name: str, build, example_batch, loss_fn):
    """A ModelSource the capture and the real step share (a model file's four names, given as functions)."""
    return ModelSource(name=name, path=None, build_model=build, example_batch=example_batch, loss_fn=loss_fn)


def timm_names() -> list[str]:
    """Each timm module's variant with the fewest parameters (counted on the meta device)."""
    import timm
    names = []
    for module in timm.list_modules():
        sized = []
        for model in timm.list_models(module=module):
            try:
                with torch.device("meta"):
                    sized.append((sum(p.numel() for p in timm.create_model(model, num_classes=CLASSES).parameters()),
                                  model))
            except Exception:      # a variant that does not build here: the family's other variants still count
                continue
        if sized:
            names.append(f"timm:{min(sized)[1]}")
    return names


def tv_names() -> list[str]:
    import torchvision
    return [f"tv:{name}" for name in torchvision.models.list_models()]


def _timm_sources(model: str):
    import timm
    default = timm.get_pretrained_cfg(model)
    default_size = default.input_size[-1] if default is not None and default.input_size else 224
    for size, keywords in ((IMAGE_SIZE, {"img_size": IMAGE_SIZE}), (IMAGE_SIZE, {}), (default_size, {})):
        build = (lambda kw=keywords: timm.create_model(model, num_classes=CLASSES, **kw))
        yield f"{size}px" + (" (img_size)" if keywords else ""), _source(
            f"timm:{model}", build, classification_batch(size), classification_loss)


def _tv_kind(model: str) -> str:
    import torchvision.models as models
    for kind, module in (("segmentation", models.segmentation), ("detection", models.detection),
                         ("video", models.video), ("flow", models.optical_flow),
                         ("quantization", models.quantization)):
        if model in models.list_models(module=module):
            return kind
    return "classification"


def _tv_sources(model: str):
    import torchvision.models as models
    kind = _tv_kind(model)
    keywords = {"weights": None, "weights_backbone": None} if kind in ("segmentation", "detection") else {}
    if kind == "detection":
        keywords |= {"num_classes": 3}
        batch = detection_batch(128, masks="mask" in model, keypoints="keypoint" in model)
        yield "128px", _source(f"tv:{model}", lambda: models.get_model(model, **keywords), batch, detection_loss)
        return
    if kind == "flow":
        for size in (IMAGE_SIZE, 128):
            yield f"{size}px", _source(f"tv:{model}", lambda: models.get_model(model), flow_batch(size), flow_loss)
        return
    keywords |= {"num_classes": CLASSES}
    if kind == "quantization":
        keywords |= {"quantize": False}
    batch_of, loss = {"segmentation": (segmentation_batch, segmentation_loss)}.get(
        kind, (classification_batch, classification_loss))
    if kind == "video":             # MViT is built for 16 frames of 224 x 224
        for size, frames in ((IMAGE_SIZE, VIDEO_FRAMES), (112, VIDEO_FRAMES), (224, 16)):
            yield f"{frames}x{size}px", _source(f"tv:{model}", lambda: models.get_model(model, **keywords),
                                                video_batch(size, frames), classification_loss)
        return
    for size in (IMAGE_SIZE, 112, 224, 299):                # Inception v3's auxiliary head needs 299
        yield f"{size}px", _source(f"tv:{model}", lambda: models.get_model(model, **keywords), batch_of(size), loss)


# tiny configs of diffusers' denoisers: (class, config, inputs(batch) -> the forward's keyword arguments)
def _unet2d(batch):
    return {"sample": torch.randn(batch, 3, 32, 32), "timestep": torch.tensor(10)}


def _unet2d_conditional(batch):
    return {"sample": torch.randn(batch, 4, 16, 16), "timestep": torch.tensor(10),
            "encoder_hidden_states": torch.randn(batch, 8, 32)}


def _dit(batch):
    return {"hidden_states": torch.randn(batch, 4, 16, 16), "timestep": torch.tensor([10] * batch),
            "class_labels": torch.randint(0, 10, (batch,))}


def _pixart(batch):
    return {"hidden_states": torch.randn(batch, 4, 16, 16), "timestep": torch.tensor([10] * batch),
            "encoder_hidden_states": torch.randn(batch, 8, 32),
            "added_cond_kwargs": {"resolution": None, "aspect_ratio": None}}


def _sd3(batch):
    return {"hidden_states": torch.randn(batch, 4, 16, 16), "timestep": torch.tensor([10] * batch),
            "encoder_hidden_states": torch.randn(batch, 8, 32), "pooled_projections": torch.randn(batch, 32)}


def _flux(batch):
    return {"hidden_states": torch.randn(batch, 64, 16), "timestep": torch.tensor([1.0] * batch),
            "encoder_hidden_states": torch.randn(batch, 8, 32), "pooled_projections": torch.randn(batch, 32),
            "txt_ids": torch.zeros(8, 3), "img_ids": torch.zeros(64, 3), "return_dict": False}


def _sana(batch):
    return {"hidden_states": torch.randn(batch, 8, 16, 16), "encoder_hidden_states": torch.randn(batch, 8, 32),
            "timestep": torch.tensor([10] * batch)}


def _auraflow(batch):
    return {"hidden_states": torch.randn(batch, 4, 16, 16), "encoder_hidden_states": torch.randn(batch, 8, 32),
            "timestep": torch.tensor([10] * batch)}


def _lumina2(batch):
    return {"hidden_states": torch.randn(batch, 4, 16, 16), "timestep": torch.tensor([0.5] * batch),
            "encoder_hidden_states": torch.randn(batch, 8, 32),
            "encoder_attention_mask": torch.ones(batch, 8, dtype=torch.bool)}


def _unet1d(batch):
    return {"sample": torch.randn(batch, 2, 256), "timestep": torch.tensor(10)}


def _unet3d(batch):
    return {"sample": torch.randn(batch, 4, 2, 16, 16), "timestep": torch.tensor(10),
            "encoder_hidden_states": torch.randn(batch, 8, 32)}


DIFFUSERS = {
    "UNet2DModel": (dict(sample_size=32, in_channels=3, out_channels=3, block_out_channels=(32, 64),
                         layers_per_block=1, norm_num_groups=8,
                         down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                         up_block_types=("AttnUpBlock2D", "UpBlock2D")), _unet2d),
    "UNet2DConditionModel": (dict(sample_size=16, in_channels=4, out_channels=4, block_out_channels=(32, 64),
                                  layers_per_block=1, norm_num_groups=8, cross_attention_dim=32,
                                  attention_head_dim=8,
                                  down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                  up_block_types=("UpBlock2D", "CrossAttnUpBlock2D")), _unet2d_conditional),
    "DiTTransformer2DModel": (dict(sample_size=16, in_channels=4, out_channels=4, num_layers=2,
                                   num_attention_heads=2, attention_head_dim=16, patch_size=2,
                                   num_embeds_ada_norm=10, norm_num_groups=8), _dit),
    "PixArtTransformer2DModel": (dict(sample_size=16, in_channels=4, out_channels=4, num_layers=2,
                                      num_attention_heads=2, attention_head_dim=16, patch_size=2,
                                      cross_attention_dim=32, caption_channels=32, norm_num_groups=8), _pixart),
    "SD3Transformer2DModel": (dict(sample_size=16, in_channels=4, out_channels=4, num_layers=2,
                                   num_attention_heads=2, attention_head_dim=16, patch_size=2,
                                   joint_attention_dim=32, caption_projection_dim=32,
                                   pooled_projection_dim=32), _sd3),
    "FluxTransformer2DModel": (dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                    attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                    pooled_projection_dim=32, axes_dims_rope=(4, 6, 6)), _flux),
    "SanaTransformer2DModel": (dict(in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=16,
                                    num_layers=2, num_cross_attention_heads=2, cross_attention_head_dim=16,
                                    cross_attention_dim=32, caption_channels=32, sample_size=16), _sana),
    "AuraFlowTransformer2DModel": (dict(sample_size=16, patch_size=2, in_channels=4, num_mmdit_layers=1,
                                        num_single_dit_layers=1, attention_head_dim=16, num_attention_heads=2,
                                        joint_attention_dim=32, caption_projection_dim=32, out_channels=4,
                                        pos_embed_max_size=64), _auraflow),
    "Lumina2Transformer2DModel": (dict(sample_size=16, patch_size=2, in_channels=4, hidden_size=32, num_layers=1,
                                       num_refiner_layers=1, num_attention_heads=2, num_kv_heads=1,
                                       multiple_of=16, axes_dim_rope=(4, 6, 6), axes_lens=(32, 32, 32),
                                       cap_feat_dim=32), _lumina2),
    "UNet1DModel": (dict(sample_size=256, in_channels=2, out_channels=2, extra_in_channels=64, block_out_channels=(32, 32, 64),
                         norm_num_groups=8), _unet1d),
    "UNet3DConditionModel": (dict(sample_size=16, in_channels=4, out_channels=4,
                                  down_block_types=("CrossAttnDownBlock3D", "DownBlock3D"),
                                  up_block_types=("UpBlock3D", "CrossAttnUpBlock3D"), block_out_channels=(32, 64),
                                  layers_per_block=1, norm_num_groups=8, cross_attention_dim=32,
                                  attention_head_dim=8), _unet3d),
}


class _Denoiser(torch.nn.Module):
    """A diffusers denoiser called as a training loop calls it: keyword inputs, the predicted noise out."""

    def __init__(self, model, inputs):
        super().__init__()
        self.model, self._inputs = model, _layout(inputs)     # where the tensors go, holding none of them

    def forward(self, *tensors):
        keywords = _rebuild(self._inputs, iter(tensors))
        out = self.model(**keywords)
        return out[0] if isinstance(out, tuple) else out.sample


_TENSOR = object()                    # a tensor's place in a layout


def _layout(value):
    if isinstance(value, torch.Tensor):
        return _TENSOR
    return {k: _layout(v) for k, v in value.items()} if isinstance(value, dict) else value


def _tensors(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _rebuild(value, tensors):
    if value is _TENSOR:
        return next(tensors)
    if isinstance(value, dict):
        return {k: _rebuild(v, tensors) for k, v in value.items()}
    return value


def _diffusers_sources(cls_name: str):
    import diffusers
    config, inputs_of = DIFFUSERS[cls_name]
    template = inputs_of(1)           # which keywords are tensors; their shapes come from inputs_of(batch)

    def build():
        return _Denoiser(getattr(diffusers, cls_name)(**config), template)

    def example_batch(batch, seq):
        tensors = _tensors(inputs_of(batch))
        return (*tensors, torch.randn_like(tensors[0]))     # each denoiser's output has its first input's shape

    yield "tiny", _source(f"diffusers:{cls_name}", build, example_batch, lambda out, noise: F.mse_loss(out, noise))


def diffusers_names() -> list[str]:
    return [f"diffusers:{name}" for name in DIFFUSERS]


def _parameter_count(source) -> int:
    """Counted on the meta device; where the builder reads a value there (torchvision's RegNet widths), on
    the CPU."""
    try:
        with torch.device("meta"):
            return sum(p.numel() for p in source.build_model().parameters())
    except NotImplementedError:
        return sum(p.numel() for p in source.build_model().parameters())


_OPERATOR_MISSING = ("torchvision::", "Could not run 'torchvision", "Couldn't load custom C++ ops")


def vision_runnable_source(name: str):
    """(source, size label): the first of the name's candidate sources whose real model builds within
    MAX_PARAMETERS and runs a real forward and backward; raises NotSteppableHere where the model reaches a
    torchvision operator this machine has no kernel for, TooLarge over MAX_PARAMETERS, else the first
    candidate's error."""
    family, model = name.split(":", 1)
    candidates = {"timm": _timm_sources, "tv": _tv_sources, "diffusers": _diffusers_sources}[family](model)
    errors = []
    for label, source in candidates:
        try:
            parameters = _parameter_count(source)
            if parameters > MAX_PARAMETERS:
                raise TooLarge(f"{parameters:,} parameters")
            torch.manual_seed(0)
            step = StepModule(source.build_model(), loss_fn=source.loss_fn)
            step(*source.example_batch(BATCH, 0)).backward()
            return source, label
        except (TimeLimit, TooLarge):
            raise
        except Exception as exc:           # the next candidate size; the first error is reported
            if any(marker in str(exc) for marker in _OPERATOR_MISSING):
                raise NotSteppableHere(_one_line(exc)) from exc
            errors.append(exc)
    raise errors[0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated names (timm:<model>, tv:<model>, diffusers:<class>)")
    parser.add_argument("--families", default="timm,tv,diffusers", help="which of timm, tv, diffusers to sweep")
    parser.add_argument("--limit", type=int, help="the first N names only")
    parser.add_argument("--json", help="write the rows as JSON here")
    parser.add_argument("--time-limit", type=int, default=240, help="seconds per model (default 240)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    if make_torchvision_importable():
        print("wild_vision: torchvision's C++ operators do not load beside this torch; torchvision::nms and "
              "torchvision::qnms are defined without kernels so that its Python models import", flush=True)
    if args.only:
        names = [n for n in args.only.split(",") if n]
    else:
        listers = {"timm": timm_names, "tv": tv_names, "diffusers": diffusers_names}
        names = [n for family in args.families.split(",") for n in listers[family]()]
    if args.limit:
        names = names[:args.limit]
    sweep(names, args.time_limit, args.json, runnable=vision_runnable_source, skips=SKIPS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
