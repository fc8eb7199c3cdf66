"""The survey of the norm classes of the installed transformers and timm: which ones
fusednorm swaps (replace_norms / replace_layernorm) and why it keeps the others.

    python scripts/norm_survey.py            # check: exit 1 if the files are stale
    python scripts/norm_survey.py --write    # rewrite docs/models.md's survey block and
                                             # fusednorm/library_classes.py

Both are generated for the library versions recorded in library_classes.VERSIONS (the
ones .ci/run pins); tests/test_norm_survey.py checks them only where those are installed.

A norm class is a class at module level of transformers/models (modeling files and the
like: not modular_*.py or convert_*.py, which are sources and converters), timm/layers or
timm/models whose name ends in Norm, Layernorm, Norm1, Norm1d/2d/3d, optionally followed
by Fp32, NoBias, Gated, 1P, PerHead, Zero, an activation suffix (Act, Act2d, ActFp32,
Act2dFp32, Tlu2d: timm's norm + activation layers), Exp2d or an EvoNorm variant (B0, S0a,
...); blocks named *NormLayer are outside it. The sources are read, never imported.

Each class is judged by its computation: the source of its methods other than __init__,
extra_repr and _load_from_state_dict, with docstrings and annotations removed and its own
name replaced, and its base classes (fusednorm._fingerprint). VERDICTS gives the verdict
for each such text (by its SHA-1), written after reading it: the fusednorm class that
computes the same, or why none does. A class whose text has no verdict (a new class, or one
whose forward changed) makes the check fail until someone reads it and adds one.
library_classes.SWAPPED records each swapped class's SHA-1: fusednorm.patch keeps a class
whose live code has another.
"""
from __future__ import annotations

import argparse
import ast
import importlib.metadata
import importlib.util
import pathlib
import re
import sys
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from fusednorm._fingerprint import computation_text, digest  # noqa: E402

TABLE = ROOT / "docs" / "models.md"  # its survey block, between BEGIN and END
BEGIN = "<!-- survey:begin (written by python scripts/norm_survey.py --write; do not edit) -->"
END = "<!-- survey:end -->"
CLASSES = ROOT / "fusednorm" / "library_classes.py"

LIBRARIES = {"transformers": ("models",), "timm": ("layers", "models")}
NAME = re.compile(r"(Norm|Layernorm)(1|[123]d)?"
                  r"(Fp32|NoBias|Gated|1P|PerHead|Zero|Act|Act2d|ActFp32|Act2dFp32|Tlu2d|Exp2d"
                  r"|B\d|S\da?)?$")

_BLOCK = ("it is a block around a norm submodule (conv/linear + norm, an encoder stack, ...), "
          "not a norm; its norm submodules are judged by their own classes")
_BATCH = "it is batch normalization (statistics over the batch): no fused op"
_GROUP = "it is group normalization: statistics over channel groups and space, no fused op"
_ZC = ("it forms 1 + weight in the weight's dtype (a 16-bit weight rounds it), where "
       "fusednorm's zero-centered weight forms it in float32")
_STEPWISE = ("it computes step by step in the input's dtype: a 16-bit input rounds at every "
             "step, which a fused op (float32 inside, one rounding) does not reproduce")

# sha1 of the computation's text -> the fusednorm class that computes the same ("Fused...")
# or why none does. The comment names one class with that text.
VERDICTS: dict[str, str] = {
    # Swapped.
    "c93d027be97e": "FusedHFRMSNorm",  # LlamaRMSNorm: normalize in fp32, cast, times weight
    "07e9c65da792": "FusedHFRMSNorm",  # CpmAntLayerNorm: the same, eps named eps
    "719748765fa2": "FusedHFRMSNorm",  # Llama4TextRMSNorm: the same, eps named eps
    "1a2d5ddfa542": "FusedHFRMSNormCastLast",  # GptOssRMSNorm: (weight * h).to(input_dtype)
    "7b44d091808d": "FusedHFRMSNormCastLast",  # HeliumRMSNorm: weight.to(fp32) * h, cast
    "3944d5a66ca2": "FusedHFRMSNormCastLast",  # MoshiRMSNorm: h * weight.float(), type_as
    "7e5c41a5c47f": "FusedHFRMSNormCastLast",  # Gemma3nRMSNorm: with_scale, pow(ms, -0.5)
    "261641347086": "FusedHFRMSNormCastLast",  # Llama4TextL2Norm: no weight, type_as
    "67e5a782a745": "FusedHFRMSNormCastLast",  # Inkling2UnweightedRMSNorm: no weight
    "a4af31fc511b": "FusedT5LayerNorm",  # T5LayerNorm: fp32 variance, weight-dtype cast
    "c716769b66a6": "FusedHFLayerNormCastLast",  # CohereLayerNorm: fp32, weight, cast
    "c1d07f627236": "FusedHFLayerNorm",  # DebertaLayerNorm: fp32, cast, weight * h + bias
    "dcf2c95fe424": "FusedParameterFreeLayerNorm",  # OlmoLayerNorm
    "5677acca593c": "FusedLayerNorm",  # EsmcLayerNorm: nn.LayerNorm's forward, .to(x.dtype)
    "916de5c594e2": "FusedLayerNorm",  # timm LayerNorm (kept while fast norm is on)
    "b8683b32af1e": "FusedLayerNorm",  # timm LayerNormNoBias: nn.LayerNorm's forward
    "386a719948f9": "FusedLayerNorm2d",  # timm LayerNorm2d (kept while fast norm is on)
    "c56287e0155e": "FusedLayerNorm2d",  # timm LayerNorm2dNoBias: timm LayerNorm2d's forward
    "4e50b8151283": "FusedLayerNorm2d",  # EomtLayerNorm2d: permute, F.layer_norm, permute
    "003074e02b6a": "FusedDataFormatLayerNorm",  # ConvNextLayerNorm: data_format
    "e0d5275419b2": "FusedLayerNormChannelsFirst",  # SqueezeBertLayerNorm: NCW
    "3e62a1f388a1": "FusedLayerNormFp32",  # EsmFold2LayerNorm: fp32 math, cast once
    "10631084a0f6": "FusedLayerNormFp32",  # timm LayerNormFp32
    "9b984f2597cc": "FusedLayerNorm2dFp32",  # timm LayerNorm2dFp32
    "ea090ac79af9": "FusedRMSNormFp32",  # timm RmsNormFp32
    "76fef532d1ac": "FusedRMSNorm2dFp32",  # timm RmsNorm2dFp32
    "f0f1a58609b8": "FusedLayerNormAct",  # timm LayerNormAct (kept while fast norm is on)
    "2e339cd6609c": "FusedLayerNormAct2d",  # timm LayerNormAct2d (kept while fast norm is on)
    "c7f123014678": "FusedLayerNormActFp32",  # timm LayerNormActFp32
    "1de36fecb922": "FusedLayerNormAct2dFp32",  # timm LayerNormAct2dFp32
    "2ddfebc0c391": "FusedRMSNormActFp32",  # timm RmsNormActFp32
    "d1edce0c41cd": "FusedRMSNormAct2dFp32",  # timm RmsNormAct2dFp32
    "4eb0a158c52c": "FusedGemmaRMSNorm",  # GemmaRMSNorm: x.float() * (1 + weight.float())
    "872bfaacabaa": "FusedGemmaRMSNorm",  # Qwen4ExpTextRMSNorm (kept when group_size is set)
    # Kept.
    "11103978f132": _BATCH,  # DetrFrozenBatchNorm2d
    "4d2f13df01c9": _BATCH,  # PatchTSTBatchNorm
    "ec8957e99f10": _BATCH,  # timm SplitBatchNorm2d
    "b5c8e0bffb44": _GROUP,  # PeAudioMaskedGroupNorm
    "2a663445a759": _GROUP,  # Emu3VQVAEGroupNorm
    "6828ee4360b7": _GROUP,  # PoolFormerGroupNorm
    "1e148583947f": _GROUP,  # timm GroupNorm, GroupNorm1
    "5b1f87d7b90b": _GROUP,  # timm GroupNorm1NoBias
    "f34a06409fbd": "its statistics are cumulative over time steps: no fused op",  # Gemma3nAudioCumulativeGroupNorm
    "a70dd37f9611": ("it gates with silu(gate) before normalizing and normalizes groups of "
                     "group_size: no fused op"),  # MambaRMSNormGated
    "26ab0203af9c": ("it gates with silu(gate) and normalizes groups of the row: no fused "
                     "op"),  # FalconH1RMSNormGated
    "c77db2f9720b": ("it multiplies the output by act(gate) in float32 before the last "
                     "cast: no fused op gates"),  # Qwen3NextRMSNormGated
    "eef99f55e24f": ("it multiplies the output by act(gate) in float32 before the last "
                     "cast: no fused op gates"),  # KimiLinearRMSNormGated
    "ca39983ca5b0": ("it rounds rsqrt(mean(x²) + eps) to the input's dtype before the "
                     "product (two roundings; a fused op rounds once)"),  # DeepseekV4UnweightedRMSNorm
    "363494dc7e4f": ("it returns rsqrt(mean(x²) + eps), one value per row, not a "
                     "normalized tensor"),  # HYV4UnweightedRMSNorm
    "4552c6b49a77": _STEPWISE,  # PocketTTSFlowLayerNorm
    "ba02aceb6395": _STEPWISE,  # GradiumPhononTTSTimestepNorm
    "2273f2aba2a3": _STEPWISE,  # ImageGPTLayerNorm
    "2f89500c76e4": _STEPWISE,  # VitDetLayerNorm
    "c4a5ae9a684c": _STEPWISE + " (timm's rms_norm)",  # timm RmsNorm
    "8a70a5698477": _STEPWISE + " (timm's rms_norm2d)",  # timm RmsNorm2d
    "8102b3baf49d": ("it divides by the root of the unbiased variance (torch.var) without "
                     "subtracting the mean: no fused op"),  # PocketTTSTimestepNorm
    "dc82a65a58ad": ("it divides by the root of the unbiased variance without subtracting "
                     "the mean (timm's simple_norm): no fused op"),  # timm SimpleNorm
    "b9688f060f81": ("it divides by the root of the unbiased variance without subtracting "
                     "the mean (timm's simple_norm): no fused op"),  # timm SimpleNorm2d
    "45b8614b4c40": ("it divides by the root of the unbiased variance without subtracting "
                     "the mean (timm's simple_norm): no fused op"),  # timm SimpleNormFp32
    "4d43fbeb0701": ("it divides by the root of the unbiased variance without subtracting "
                     "the mean (timm's simple_norm): no fused op"),  # timm SimpleNorm2dFp32
    "4edbed208adb": ("it divides by the root of the sum of squares (an L2 norm), not of "
                     "their mean"),  # DoryL2Norm
    "1c093938232a": ("it divides queries and keys by their L2 norm clamped at the dtype's "
                     "eps, in the input's dtype: no fused op"),  # ZayaQKNorm
    "c9d6106d3b77": ("it is global response normalization (an L2 norm over space over its mean "
                     "across channels): no fused op"),  # timm GlobalResponseNorm
    "d0f88c5273c4": ("it applies weight and bias after F.layer_norm has rounded (two "
                     "roundings), with a weight of more dims than it normalizes"),  # ChameleonLayerNorm
    "67e61d442134": _ZC + ", and casts its arguments for autocast itself",  # NemotronLayerNorm1P
    "cc5feac648b4": _ZC,  # VideoPrismLayerNorm
    "f630c5f7e2b9": _ZC,  # MuseSparkTextCenteredRMSNorm
    "f3ae2acb60c6": ("it scales the input by 1 + weight and rounds before normalizing: no "
                     "fused op scales before the statistics"),  # MuseSparkTextInputScaledRMSNorm
    "bac38ec8e08e": ("it casts its float32 parameters to bfloat16 for a bfloat16 input and "
                     "turns autocast off around F.layer_norm: fusednorm's layer_norm could "
                     "compute it, but no swap target is written for this one class"),  # EsmFoldLayerNorm
    "49a9e19c1356": ("it is an integer-only quantized LayerNorm (I-BERT); unquantized it computes "
                     "step by step in the input's dtype"),  # IntLayerNorm
    "528ee8d44f5d": "it does not normalize: an elementwise affine map",  # MobileBert NoNorm
    "6dbee1f3dead": ("it does not normalize: linear, GELU, linear (the conditioning MLP of "
                     "an adaptive norm)"),  # VoxtralRealtimeTextAdaRmsNorm
    "5b1422765ff6": ("it is an adaptive norm: a gate and a shift computed from a second input "
                     "modulate the normalized output"),  # EsmFold2AdaptiveLayerNorm
    "6f027e072ef0": ("it is an adaptive norm: scale and shift from a conditioning input, around "
                     "an nn.LayerNorm submodule (swapped on its own)"),  # Qwen2_5_OmniAdaLayerNormZero
    "a8ab82174358": ("it is an adaptive norm: scale and shift from a conditioning input, around "
                     "a norm submodule (judged on its own)"),  # VibeVoiceDiffusionHeadAdaLayerNorm
    "1d391633fe84": ("it is an adaptive norm: scale and shift from an embedding of a second "
                     "input, applied after F.layer_norm has rounded"),  # WavTokenizerAdaLayerNorm
    "0e34a9214827": ("it subtracts the mean over the sequence after its nn.LayerNorm "
                     "submodule (swapped on its own)"),  # AutoformerLayernorm
    "f6f3f713a736": ("it scales its nn.LayerNorm submodule's rounded output by gamma + "
                     "unit_offset (the submodule is swapped on its own)"),  # MoonshineStreamingLayerNorm
    "3a93583224a1": ("it is a list of nn.LayerNorms, one per head, applied to slices (each "
                     "swapped on its own)"),  # StableLmLayerNormPerHead
    "845faf0015b3": _BATCH,  # timm BatchNormAct2d
    "4f90ceef6715": _BATCH,  # timm FrozenBatchNormAct2d
    "489bf5cde8fc": _BATCH,  # timm SyncBatchNormAct
    "b85dd9ea8d4e": _GROUP,  # timm GroupNormAct, GroupNorm1Act
    "9c4d7baaf775": _STEPWISE + " (timm's rms_norm)",  # timm RmsNormAct
    "a7dc7464af22": _STEPWISE + " (timm's rms_norm2d)",  # timm RmsNormAct2d
    "51a8166c3dfc": ("a channels-last (non-contiguous) input goes through its own "
                     "_layer_norm_cf, which " + _STEPWISE[3:]),  # timm LayerNormExp2d
    "4e4b7bcb6024": ("it is filter response normalization (mean of squares over space, per "
                     "channel): no fused op"),  # timm FilterResponseNormAct2d
    "77605b2478cc": ("it is filter response normalization (mean of squares over space, per "
                     "channel): no fused op"),  # timm FilterResponseNormTlu2d
    "5ae1866b8856": "it is EvoNorm (batch or group statistics, a gate of the input): no fused op",  # B0
    "076ab18241f2": "it is EvoNorm (batch or group statistics, a gate of the input): no fused op",  # B1
    "8381bc59e529": "it is EvoNorm (batch or group statistics, a gate of the input): no fused op",  # B2
    "1fa5a346b100": "it is EvoNorm (batch or group statistics, a gate of the input): no fused op",  # S0
    "f465678c6d9d": "it is EvoNorm (batch or group statistics, a gate of the input): no fused op",  # S0a
    "6122c59bb7bb": "it is EvoNorm (batch or group statistics, a gate of the input): no fused op",  # S1
    "5021f501354a": "it is EvoNorm (batch or group statistics, a gate of the input): no fused op",  # S1a
    "c429f90ec85f": "it is EvoNorm (batch or group statistics, a gate of the input): no fused op",  # S2
    "6fa147e46d3a": "it is EvoNorm (batch or group statistics, a gate of the input): no fused op",  # S2a
    "ab6d4b8374c8": _BLOCK,  # timm ConvNormAct
    "6a2812d3dd83": _BLOCK,  # timm efficientvit_mit ConvNormAct
    "26df7ccbc39c": _BLOCK,  # timm nextvit ConvNormAct
    "9c2701397f24": _BLOCK,  # timm SeparableConvNormAct
    "849fcbd891aa": _BLOCK,  # Emu3VQVAESpatialNorm
    "b585c9badc65": _BLOCK,  # AXK2GatedRMSNorm
    "6cf023907001": _BLOCK,  # DbrxNormAttentionNorm
    "974648d0abe1": _BLOCK,  # SqueezeBert ConvDropoutLayerNorm
    "95d476d0009f": _BLOCK,  # Wav2Vec2EncoderLayerStableLayerNorm
    "ceda4a5d820c": _BLOCK,  # Wav2Vec2EncoderStableLayerNorm
    "32d8e1812fa8": _BLOCK,  # WavLMEncoderLayerStableLayerNorm
    "9b696f60091d": _BLOCK,  # WavLMEncoderStableLayerNorm
    "09915c999b3d": _BLOCK,  # timm tiny_vit ConvNorm
    "3a30e6d6ceb8": _BLOCK,  # timm ConvNorm
    "3ccb10643dfa": _BLOCK,  # timm ConvNorm
    "7c3460982cc7": _BLOCK,  # timm ConvNorm
    "c8cdeebb9424": _BLOCK,  # timm ConvNorm
    "0efa03b3638d": _BLOCK,  # timm Conv2dNorm
    "07f7211d7866": _BLOCK,  # timm LinearNorm
    "f71453701a04": _BLOCK,  # timm ConvMlpWithNorm
    "15b30c441c15": _BLOCK,  # timm ConvMlpWithNorm
    "e2d852533060": _BLOCK,  # timm EvaBlockPostNorm
}


@dataclass(frozen=True)
class NormClass:
    library: str
    name: str  # 'module.QualName', the key of fusednorm.patch.SWAPS
    digest: str  # fusednorm._fingerprint.digest of the computation's text
    text: str


def library_root(library: str) -> pathlib.Path | None:
    spec = importlib.util.find_spec(library)
    return None if spec is None or spec.origin is None else pathlib.Path(spec.origin).parent


def norm_classes(library: str) -> list[NormClass]:
    """The norm classes of an installed library, sorted by name."""
    root = library_root(library)
    found = []
    for folder in LIBRARIES[library]:
        for path in sorted((root / folder).rglob("*.py")):
            if path.name.startswith(("modular_", "convert_")):
                continue
            module = ".".join((library, *path.relative_to(root).with_suffix("").parts))
            for node in ast.parse(path.read_text(encoding="utf-8")).body:
                if isinstance(node, ast.ClassDef) and NAME.search(node.name):
                    text = computation_text(node)
                    found.append(NormClass(library, f"{module}.{node.name}", digest(text), text))
    return sorted(found, key=lambda c: c.name)


def installed() -> dict[str, str]:
    """The surveyed libraries that are installed, with their versions."""
    return {lib: importlib.metadata.version(lib) for lib in LIBRARIES if library_root(lib)}


def survey() -> tuple[dict[str, list[NormClass]], list[NormClass]]:
    """The norm classes of each installed library, and those without a verdict."""
    classes = {lib: norm_classes(lib) for lib in installed()}
    unjudged = [c for cs in classes.values() for c in cs if c.digest not in VERDICTS]
    return classes, unjudged


def is_swap(verdict: str) -> bool:
    return verdict.startswith("Fused")


def render_table(versions: dict[str, str], classes: dict[str, list[NormClass]]) -> str:
    """docs/models.md's survey block, the markers included."""
    lines = [
        BEGIN,
        "",
        "From " + " and ".join(f"{lib} {v}" for lib, v in versions.items()) + ". "
        "\"swapped\": `fusednorm.replace_norms` turns the class into the fusednorm class named "
        "(`replace_layernorm` does so for the LayerNorm ones), which computes what the class "
        "computes, in its order of operations and with its cast rule. \"kept\": left as it "
        "is, for the reason given. float64 inputs of swapped classes that cast to float32 are "
        "computed in float64.",
        "",
    ]
    for lib, found in classes.items():
        swapped = sum(is_swap(VERDICTS[c.digest]) for c in found)
        lines += [f"### {lib} {versions[lib]}: {len(found)} classes, {swapped} swapped", "",
                  "| class | verdict |", "|---|---|"]
        for c in found:
            verdict = VERDICTS[c.digest]
            text = f"swapped: `{verdict}`" if is_swap(verdict) else f"kept, because {verdict}"
            lines.append(f"| `{c.name}` | {text} |")
        lines.append("")
    return "\n".join(lines + [END])


def with_block(page: str, block: str) -> str:
    """page with the text between the markers (inclusive) replaced by block."""
    start, end = page.find(BEGIN), page.find(END)
    if start < 0 or end < start:
        raise ValueError(f"{TABLE.name} lacks the markers {BEGIN!r} ... {END!r}")
    return page[:start] + block + page[end + len(END):]


def render_classes(versions: dict[str, str], classes: dict[str, list[NormClass]]) -> str:
    lines = [
        '"""The other libraries\' norm classes that fusednorm swaps, and the fusednorm class',
        "each becomes (fusednorm.patch.SWAPS builds its entries from this). Generated by",
        "scripts/norm_survey.py from " + " and ".join(f"{lib} {v}" for lib, v in versions.items())
        + "; do not edit.",
        '"""',
        "",
        "# The library versions surveyed.",
        "VERSIONS: dict[str, str] = {"
        + ", ".join(f'"{lib}": "{v}"' for lib, v in versions.items()) + "}",
        "",
        "# 'module.QualName' -> (the fusednorm class it becomes, the fingerprint of the class",
        "# judged: fusednorm._fingerprint). A class whose code has another fingerprint is kept.",
        "SWAPPED: dict[str, tuple[str, str]] = {",
    ]
    for found in classes.values():
        for c in found:
            if is_swap(VERDICTS[c.digest]):
                lines.append(f'    "{c.name}": ("{VERDICTS[c.digest]}", "{c.digest}"),')
    lines += ["}", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite the generated files")
    args = parser.parse_args(argv)
    versions = installed()
    if set(versions) != set(LIBRARIES):
        print(f"needs {' and '.join(LIBRARIES)} installed, found {sorted(versions)}")
        return 1
    classes, unjudged = survey()
    if unjudged:
        for c in unjudged:
            print(f"no verdict: {c.name} ({c.digest})\n{c.text}\n")
        return 1
    outputs = {TABLE: with_block(TABLE.read_text(), render_table(versions, classes)),
               CLASSES: render_classes(versions, classes)}
    stale = [path for path, text in outputs.items()
             if not path.exists() or path.read_text() != text]
    if args.write:
        for path in stale:
            path.write_text(outputs[path])
            print(f"wrote {path.relative_to(ROOT)}")
        return 0
    for path in stale:
        print(f"stale: {path.relative_to(ROOT)} (run scripts/norm_survey.py --write)")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
