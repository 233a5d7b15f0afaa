"""The registry of families: one place keyed by ``model_type``, imported on demand.

(a) no ``model_type`` list exists outside ``nnterp/families``;
(b) ``import nnterp.families`` (and ``import nnterp``) imports no transformers modeling module;
(c) an unknown ``model_type`` raises `UnsupportedModel` naming the fix;
(d) a family inherits its sibling's declarations and restates only what differs;
(e) every registered model type's tiny config builds, with that ``model_type``.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import nnterp
from nnterp.families import ALIASES, MODEL_TYPES, REGISTRY, FamilyAbsent, absent, families, family_for, present
from nnterp.families.base import Family
from nnterp.testing import tiny_config
from tests.suites.checkpoint import model_type_params

ROOT = Path(__file__).resolve().parents[2]

#: Where a literal naming several model types is the registry itself.
ALLOWED = {ROOT / "nnterp" / "families"}
#: The oracles' own tests build plain transformers models of a few architectures, sized on purpose
#: and independent of nnterp (no family is read there); their table lists builders, not families.
EXEMPT = {ROOT / "tests" / "reference" / "test_hf_oracles.py"}


def _sources() -> list[Path]:
    skip = {"site-packages", "node_modules", "build", "site"}
    return [
        path for path in sorted(ROOT.rglob("*.py"))
        if not any(part.startswith(".") or part in skip for part in path.relative_to(ROOT).parts[:-1])
    ]


def _model_type_literals(path: Path) -> list[str]:
    """``"file:line [types]"`` for each tuple/list/set/dict literal naming 3 or more registered model types."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            items = node.elts
        elif isinstance(node, ast.Dict):
            items = [key for key in node.keys if key is not None] + node.values
        else:
            continue
        named = {item.value for item in items if isinstance(item, ast.Constant) and item.value in MODEL_TYPES}
        if len(named) >= 3:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} {sorted(named)}")
    return found


def test_no_model_type_list_outside_the_registry():
    offenders = [
        hit
        for path in _sources()
        if path not in EXEMPT and not any(folder in path.parents for folder in ALLOWED)
        for hit in _model_type_literals(path)
    ]
    assert not offenders, (
        "a model_type list outside nnterp/families: derive it from nnterp.families (REGISTRY, families(), "
        "a family's declarations) instead:\n" + "\n".join(offenders)
    )


def test_the_scan_sees_the_registry_alias_map():
    assert _model_type_literals(ROOT / "nnterp" / "families" / "__init__.py"), "the scan would miss a model_type list"


@pytest.mark.parametrize("module", ["nnterp.families", "nnterp"])
def test_importing_imports_no_modeling_module(module):
    code = (
        "import json, sys\n"
        f"import {module}\n"
        "from nnterp.families import REGISTRY\n"
        "keys = sorted(REGISTRY)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('transformers.models.') "
        "and '.modeling_' in m and not m.startswith('transformers.models.auto.'))))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []


def test_looking_up_one_family_imports_its_file_and_its_siblings_only():
    code = (
        "import json, sys\n"
        "from nnterp.families import REGISTRY\n"
        "REGISTRY['mamba2']\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('nnterp.families.'))))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert loaded == ["nnterp.families.base", "nnterp.families.llama", "nnterp.families.mamba", "nnterp.families.mamba2"]


def test_an_unknown_model_type_names_the_fix():
    for unknown in ("bert", type("Config", (), {"model_type": "bert"})()):
        with pytest.raises(nnterp.UnsupportedModel) as raised:
            family_for(unknown)
        message = str(raised.value)
        assert "'bert'" in message and all(model_type in message for model_type in MODEL_TYPES)
        assert "nnterp/families/bert.py" in message and "tests/families/test_bert.py" in message
    assert "bert" not in REGISTRY
    with pytest.raises(KeyError):
        REGISTRY["bert"]


def test_the_registry_is_keyed_by_every_model_type_each_family_serves():
    assert MODEL_TYPES == tuple(sorted(REGISTRY)) == tuple(sorted(set(REGISTRY)))
    served = sorted(model_type for family in families() for model_type in family.MODEL_TYPES)
    assert served == list(present()), "each model type the installed release has is served by exactly one family"
    for model_type in MODEL_TYPES:
        if absent(model_type) is not None:
            with pytest.raises(FamilyAbsent, match=model_type):  # a later release's family: reported absent, by name
                family_for(model_type)
            continue
        family = REGISTRY[model_type]
        assert family_for(model_type) is family and model_type in family.MODEL_TYPES
        assert family.NAME == ALIASES.get(model_type, model_type)
        assert (ROOT / "nnterp" / "families" / f"{family.NAME}.py").is_file()


def test_each_family_subclasses_its_sibling():
    # The tree is the families' own declarations: each names its sibling in its docstring and subclasses it.
    assert REGISTRY["llama"].__base__ is Family
    for family in families():
        assert issubclass(family, Family)
        assert family.__doc__ and "Features of the architecture" in family.__doc__, family.NAME
        if family.__base__ is not Family:
            assert f"as the difference from `{family.__base__.NAME}`" in family.__doc__, family.NAME


def test_a_family_inherits_what_it_does_not_restate():
    qwen3_5 = REGISTRY["qwen3_5_text"]
    next_, mamba, mamba2 = REGISTRY["qwen3_next"], REGISTRY["mamba"], REGISTRY["mamba2"]
    llama = REGISTRY["llama"]
    for name in ("LAYERS", "EMBED_TOKENS", "LN_FINAL", "LM_HEAD", "LAYER", "LAYER_TYPES"):
        assert name not in vars(next_), f"Qwen3Next restates {name}"
        assert getattr(next_, name) is getattr(qwen3_5, name)
    assert next_.layer_parts.__func__ is qwen3_5.layer_parts.__func__
    assert next_.text_config.__func__ is qwen3_5.text_config.__func__
    assert qwen3_5.LAYERS == llama.LAYERS and "LAYERS" not in vars(qwen3_5)
    assert mamba2.LAYERS == mamba.LAYERS == "backbone.layers" and "LAYERS" not in vars(mamba2)
    assert mamba2.LAYER is mamba.LAYER and mamba2.layer_parts.__func__ is mamba.layer_parts.__func__
    assert mamba.LM_HEAD == llama.LM_HEAD and "LM_HEAD" not in vars(mamba)


def test_every_family_declares_its_own_transformers_classes():
    for family in families():
        own = vars(family)
        for name in ("MODELING", "CONFIG", "MODEL_TYPES", "DECODER_LAYERS", "COMPONENTS"):
            assert name in own, f"{family.__name__} inherits {name} from {family.__base__.__name__}"
        assert family.CONFIG.model_type == family.MODEL_TYPES[0]
        for hf_class in (*family.DECODER_LAYERS, *family.COMPONENTS):
            assert hf_class.__module__ == family.MODELING.__name__, f"{family.__name__}: {hf_class.__name__}"
        envoys = family.envoys()
        assert all(envoys[block] is family.LAYER for block in family.DECODER_LAYERS)
        if family.MIXER is not None:
            assert family.MIXER in family.COMPONENTS.values()


def test_real_checkpoints_are_a_familys_own():
    assert REGISTRY["olmo_hybrid"].REAL_CHECKPOINTS == {}, "not Qwen3.5's, which it subclasses"
    for family in families():
        for checkpoint, real in family.REAL_CHECKPOINTS.items():
            assert real.source, checkpoint
            config = family.real_config(checkpoint)
            assert config.model_type == family.MODEL_TYPES[0]
            assert all(getattr(config, key) == value for key, value in real.sizes.items()), checkpoint


@pytest.mark.parametrize("model_type", model_type_params(MODEL_TYPES))
def test_every_model_type_has_a_tiny_config(model_type):
    config = tiny_config(model_type)
    assert config.model_type == model_type
    family = REGISTRY[model_type]
    text = family.text_config(config)
    # The text model's type: the family's own, or, for a composite served as transformers loads it
    # whole (gemma3), the family of the text model it contains.
    assert text.model_type == family.MODEL_TYPES[0] or (type(config) is family.COMPOSITE_CONFIG and issubclass(family, REGISTRY[text.model_type]))
    parts = family.layer_parts(config)
    assert parts and all(parts)
    assert config.to_dict() == family.tiny_config(model_type, **{
        key: getattr(family.text_config(config), key) for key in ("vocab_size", "eos_token_id", "bos_token_id", "pad_token_id")
    }).to_dict()


def test_a_familys_file_is_reached_as_the_spec_names_it():
    import nnterp.recurrent.routing as routing

    qwen3_5 = nnterp.families.qwen3_5_text  # imported on first use, like REGISTRY's values
    assert qwen3_5.Qwen3_5Text is REGISTRY["qwen3_5_text"]
    assert routing.family_of(qwen3_5) is routing.family_of(qwen3_5.Qwen3_5Text) is qwen3_5.Qwen3_5Text
    assert routing.mixers_of(qwen3_5) == routing.mixers_of(qwen3_5.Qwen3_5Text)
    with pytest.raises(AttributeError):
        nnterp.families.not_a_family


def test_the_readme_lists_every_registered_model_type():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("| family (`model_type`) |"):readme.index("## Benchmarks")]
    missing = [model_type for model_type in MODEL_TYPES if f"`{model_type}`" not in table]
    assert not missing, f"README's family table lacks {missing}"
