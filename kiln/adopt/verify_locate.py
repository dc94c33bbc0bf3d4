"""Where `kiln adopt --verify transformers:<model_type>` finds the modeling file, and how it loads the
rewritten copy next to it.

Model types are spelled as transformers spells them (`bert-generation`, `data2vec-audio`) or by their
modeling file (`data2vec_audio`); the package comes from transformers' own `model_type_to_module_name`
(`kosmos-2` -> kosmos2, deprecated models under deprecated/).
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

from kiln.errors import KilnError


class VerifyError(KilnError):
    """The check cannot be run (bad spec, model type, environment, or the original model fails)."""


# -- locating and loading the modeling file --------------------------------------------------------

def parse_spec(spec: str) -> str:
    """`transformers:llama` -> "llama" (the only source supported so far)."""
    source, sep, model_type = spec.partition(":")
    if not sep or source != "transformers" or not model_type.strip():
        raise VerifyError(f"--verify {spec!r}: expected transformers:<model_type>, e.g. transformers:llama")
    return model_type.strip()


def resolve_type(name: str) -> str:
    """The model type `name` is (`bert-generation`), or whose modeling file it names (`data2vec_audio`,
    `bert_generation`); VerifyError when transformers has neither."""
    try:
        import transformers
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    except ImportError as exc:
        raise VerifyError(f"--verify needs transformers, which cannot be imported ({exc}); "
                          f"pip install transformers") from None
    if name in CONFIG_MAPPING_NAMES:
        return name
    models = Path(transformers.__file__).parent / "models"
    for t in CONFIG_MAPPING_NAMES:
        if any(p.stem == f"modeling_{name}" and p.is_file() for p in _candidates(models, t)[:1]):
            return t
    raise VerifyError(f"transformers:{name}: unknown model type in transformers "
                      f"{transformers.__version__} (e.g. llama, gpt2, bert, t5)")


def modeling_path(model_type: str) -> Path:
    """The installed modeling file of `model_type` (see resolve_type); VerifyError naming what is missing."""
    import transformers

    model_type = resolve_type(model_type)
    candidates = _candidates(Path(transformers.__file__).parent / "models", model_type)
    path = next((p for p in candidates if p.is_file()), None)
    if path is None:
        raise VerifyError(f"transformers:{model_type}: no modeling file at {candidates[0]} (the model type is "
                          f"defined in another model's package; verify that one instead)")
    return path


def _candidates(models: Path, model_type: str) -> list[Path]:
    """Where `model_type`'s modeling file may be: its package as transformers names it
    (`data2vec-audio` -> data2vec, `kosmos-2` -> kosmos2, deprecated models under deprecated/), the
    file named after the model type (modeling_data2vec_audio.py) or after the package."""
    try:
        from transformers.models.auto.configuration_auto import model_type_to_module_name
        package = model_type_to_module_name(model_type)
    except ImportError:
        package = model_type.replace("-", "_")
    folder = models.joinpath(*package.split("."))
    return [folder / f"modeling_{model_type.replace('-', '_')}.py", folder / f"modeling_{package.split('.')[-1]}.py"]


def module_names(model_type: str) -> tuple[str, str]:
    """(the installed module, the overlay's module name next to it in the same package)."""
    import transformers

    path = modeling_path(model_type)
    relative = path.relative_to(Path(transformers.__file__).parent).with_suffix("")
    original = ".".join(("transformers",) + relative.parts)
    return original, original + "_kiln_adopted"


def load_overlay(model_type: str, path: str):
    """Execute the rewritten file at `path` as a sibling module of the installed one.

    Registered in sys.modules before it runs (dataclasses and transformers' decorators look their
    module up there); a previous overlay of the same model is replaced, never reused."""
    importlib.import_module(module_names(model_type)[0])      # the package and its parents
    name = module_names(model_type)[1]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module
