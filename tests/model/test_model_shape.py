"""ModelShape is the one shape type: the model's config, the simulator's spec and the bench's
roofline read the same fields."""

from __future__ import annotations

from conveyor.model.config import ModelConfig
from conveyor.model.loader import read_model_config
from conveyor.model.shape import ModelShape
from conveyor.sim.specs import load_model


def test_the_sim_spec_of_the_default_model_has_the_shipped_models_shape():
    shipped = read_model_config(None)
    assert isinstance(shipped, ModelShape)
    assert load_model("smollm2-135m").shape_dict() == shipped.shape_dict()


def test_model_config_takes_its_fields_by_name_and_name_architecture_by_position():
    config = ModelConfig("tiny", "llama", num_layers=2, hidden_size=8, intermediate_size=16,
                         num_heads=2, num_kv_heads=1, head_dim=4, vocab_size=10,
                         max_position_embeddings=32, eos_token_ids=[1])
    assert (config.name, config.architecture, config.eos_token_ids) == ("tiny", "llama", [1])
    assert config.num_queries_per_kv == 2 and not config.tie_word_embeddings
    assert ModelShape.from_dict({"name": "tiny", **config.shape_dict()}).num_layers == 2
