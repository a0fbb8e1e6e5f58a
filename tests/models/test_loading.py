"""Model specs resolve to clear errors; tokenizers load as saved (no false Mistral-regex 'fix')."""
import json

import pytest

from osd.errors import ModelNotFound
from osd.models.loading import resolve_model_dir, tokenizer_kwargs


def test_bad_specs_give_clear_errors(tmp_path):
    with pytest.raises(ModelNotFound, match="empty model spec"):
        resolve_model_dir("")
    with pytest.raises(ModelNotFound, match="no config.json"):
        resolve_model_dir(str(tmp_path))
    with pytest.raises(ModelNotFound, match="GGUF file not found"):
        resolve_model_dir(str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelNotFound, match="not found"):
        resolve_model_dir("./no/such/dir")


@pytest.mark.parametrize("model_type, expected", [("qwen2", {"fix_mistral_regex": False}), ("llama", {"fix_mistral_regex": False}),
                                                  ("mistral", {}), (None, {})])
def test_only_non_mistral_local_tokenizers_decline_the_regex_patch(tmp_path, model_type, expected):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type} if model_type else {}))
    assert tokenizer_kwargs(str(tmp_path)) == expected
    assert tokenizer_kwargs("Qwen/Qwen2.5-0.5B") == {}  # a hub id: nothing local to read
