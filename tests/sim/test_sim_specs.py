"""Spec files: every built-in loads with the right sizes; bad files give errors naming the field."""

import pytest

from conveyor.sim.specs import list_specs, load_hardware, load_model

EXPECTED_PARAMS_B = {  # published parameter counts, billions
    "llama-3-8b": 8.03, "llama-3-70b": 70.55, "qwen3-0.6b": 0.596, "qwen3-8b": 8.19,
    "smollm2-135m": 0.1345, "gemma3-270m": 0.268,
}


def test_builtin_specs_are_all_there():
    assert set(list_specs("models")) >= set(EXPECTED_PARAMS_B)
    assert set(list_specs("hardware")) >= {"h100-sxm", "h200", "a100-80g", "l4",
                                           "rtx-4070-laptop", "this-cpu"}
    for name in list_specs("hardware"):
        assert load_hardware(name).name == name


@pytest.mark.parametrize("name, billions", sorted(EXPECTED_PARAMS_B.items()))
def test_model_param_counts(name, billions):
    spec = load_model(name)
    assert spec.name == name
    assert spec.num_params / 1e9 == pytest.approx(billions, rel=0.01)


def test_spec_from_a_path(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("name: mine\nmemory_gb: 10\npeak_matrix_tflops: 5\nmemory_bandwidth_gbs: 100\n")
    spec = load_hardware(path)
    assert (spec.name, spec.memory_gb, spec.matmul_efficiency) == ("mine", 10.0, 1.0)


@pytest.mark.parametrize("body, match", [
    ("name: x\nmemory_gb: 10\npeak_matrix_tflops: 5\n", "missing required field.*memory_bandwidth_gbs"),
    ("name: x\nmemory_gb: 10\npeak_matrix_tflops: 5\nmemory_bandwidth_gbs: 1\nbogus: 1\n",
     "unknown field.*bogus"),
    ("name: x\nmemory_gb: -10\npeak_matrix_tflops: 5\nmemory_bandwidth_gbs: 1\n", "memory_gb must be > 0"),
    ("name: x\nmemory_gb: 10\npeak_matrix_tflops: fast\nmemory_bandwidth_gbs: 1\n",
     "peak_matrix_tflops must be a number"),
    ("name: x\nmemory_gb: 10\npeak_matrix_tflops: 5\nmemory_bandwidth_gbs: 1\nmatmul_efficiency: 1.5\n",
     "matmul_efficiency must be in"),
    ("- just\n- a list\n", "expected a mapping"),
    ("name: [unclosed\n", "not valid YAML"),
])
def test_bad_hardware_spec(tmp_path, body, match):
    path = tmp_path / "bad.yaml"
    path.write_text(body)
    with pytest.raises(ValueError, match=match):
        load_hardware(path)


def test_bad_model_spec(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("name: m\nnum_layers: 2\nhidden_size: 8\nintermediate_size: 8\nnum_heads: 3\n"
                    "num_kv_heads: 2\nhead_dim: 4\nvocab_size: 10\nmax_position_embeddings: 16\n")
    with pytest.raises(ValueError, match="num_heads .3. must be a multiple of num_kv_heads .2."):
        load_model(path)
    path.write_text(path.read_text().replace("num_layers: 2", "num_layers: 2.5"))
    with pytest.raises(ValueError, match="num_layers must be an integer"):
        load_model(path)


def test_unknown_names_list_the_builtins(tmp_path):
    with pytest.raises(ValueError, match="unknown hardware spec 'h1000'.*h100-sxm"):
        load_hardware("h1000")
    with pytest.raises(ValueError, match="unknown models spec 'gpt-5'.*llama-3-8b"):
        load_model("gpt-5")
    with pytest.raises(ValueError, match="not found"):
        load_model(tmp_path / "missing.yaml")


def test_the_simulator_never_imports_torch():
    import subprocess
    import sys

    code = ("import sys, conveyor.sim.cli, conveyor.sim.runner, conveyor.sim.fleet; "
            "conveyor.sim.cli.main(['--list-specs']); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().endswith("False")
