"""Self-tests of the PyTorch reference trainer (test/e2e/torch_reference.py).

Run: /usr/bin/python3 -m unittest test/e2e/test_torch_reference.py
  or /usr/bin/python3 test/e2e/test_torch_reference.py
"""

import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import unittest

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import safetensors_io  # noqa: E402
import torch_reference as ref  # noqa: E402

GPT_SPEC = {
    "model": {"family": "gpt", "vocab_size": 256, "seq_len": 64, "layers": 2, "hidden": 64,
              "heads": 4, "ffn_hidden": 256},
    "train": {"global_batch": 8, "steps": 20, "seed": 1234},
}
LLAMA_SPEC = {
    "model": {"family": "llama", "vocab_size": 256, "seq_len": 64, "layers": 2, "hidden": 64,
              "heads": 4, "kv_heads": 2, "ffn_hidden": 172},
    "train": {"global_batch": 8, "steps": 20, "seed": 1234},
}


def setUpModule():
    torch.set_num_threads(min(2, torch.get_num_threads()))


class RefTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="torch_ref_test_")

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def path(self, name):
        return os.path.join(self.tmp, name)

    def random_tokens(self, n=8 * 64 * 6 + 1, V=256, seed=0, uint32=False):
        p = self.path("rand.bin")
        ref.write_tokens(p, np.random.default_rng(seed).integers(0, V, n), uint32=uint32)
        return p

    def init_model(self, spec, dtype=torch.float32):
        mcfg, tcfg = ref.load_spec(spec)
        f = self.path(mcfg["family"] + ".init.safetensors")
        if not os.path.exists(f):
            ref.write_init(mcfg, tcfg["seed"], f)
        model = ref.build_model(mcfg)
        ref.load_weights(model, f)
        return model.to(dtype), mcfg, tcfg


class SafetensorsTest(RefTest):
    def test_round_trip(self):
        rng = np.random.default_rng(1)
        t = {"a.weight": rng.standard_normal((3, 5)).astype(np.float32),
             "b": rng.standard_normal(7).astype(np.float32),
             "scalar": np.array(2.5, dtype=np.float32),
             "wide": rng.standard_normal((2, 2))}  # float64 kept as F64
        p = self.path("x.safetensors")
        safetensors_io.save_file(t, p, metadata={"format": "pt"})
        back = safetensors_io.load_file(p)
        self.assertEqual(sorted(back), sorted(t))
        for k in t:
            self.assertEqual(back[k].dtype, t[k].dtype)
            np.testing.assert_array_equal(back[k], t[k])
        self.assertEqual(safetensors_io.load_metadata(p), {"format": "pt"})
        with open(p, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
        self.assertEqual((8 + n) % 8, 0)

    def test_read_half_types(self):
        # Hand-built file with F16 and BF16 tensors.
        vals = np.array([1.0, -2.5, 0.15625, 3e4], dtype=np.float32)
        f16 = vals.astype("<f2").tobytes()
        bf16 = (vals.view(np.uint32) >> 16).astype("<u2").tobytes()  # exact for these values
        header = {"h": {"dtype": "F16", "shape": [2, 2], "data_offsets": [0, 8]},
                  "b": {"dtype": "BF16", "shape": [4], "data_offsets": [8, 16]}}
        hb = json.dumps(header).encode()
        p = self.path("half.safetensors")
        with open(p, "wb") as f:
            f.write(struct.pack("<Q", len(hb)) + hb + f16 + bf16)
        back = safetensors_io.load_file(p)
        np.testing.assert_array_equal(back["h"].astype(np.float32).ravel(),
                                      vals.astype(np.float16).astype(np.float32))
        np.testing.assert_array_equal(back["b"], np.array([1.0, -2.5, 0.15625, 29952.0],
                                                          dtype=np.float32))


class DataAndScheduleTest(RefTest):
    def test_token_files_and_batches(self):
        toks = np.arange(1000) % 300
        for u32 in (False, True):
            p = self.path("t.bin")
            ref.write_tokens(p, toks, uint32=u32)
            back = ref.load_tokens(p)
            np.testing.assert_array_equal(back, toks)
        # nSamples = (1000 - 1) // 64 = 15; step 2, B = 8 -> j = 16 % 15 = 1, ...
        x, y = ref.get_batch(back, 2, 8, 64)
        self.assertEqual(tuple(x.shape), (8, 64))
        np.testing.assert_array_equal(x[0].numpy(), toks[64:128])
        np.testing.assert_array_equal(y[0].numpy(), toks[65:129])
        np.testing.assert_array_equal(x[7].numpy(), toks[8 * 64:9 * 64])

    def test_lr_schedule(self):
        _, t = ref.load_spec({"train": {"optimizer": {"lr": 1.0}, "lr_schedule": {
            "warmup_steps": 4, "decay": "cosine", "min_lr": 0.1}}})
        self.assertAlmostEqual(ref.lr_at(0, 14, t), 0.25)
        self.assertAlmostEqual(ref.lr_at(3, 14, t), 1.0)
        self.assertAlmostEqual(ref.lr_at(4, 14, t), 1.0)
        self.assertAlmostEqual(ref.lr_at(9, 14, t), 0.1 + 0.5 * 0.9)
        self.assertAlmostEqual(ref.lr_at(14, 14, t), 0.1)
        t["lr_schedule"]["decay"] = "linear"
        self.assertAlmostEqual(ref.lr_at(9, 14, t), 1.0 + (0.1 - 1.0) * 0.5)
        t["lr_schedule"]["decay"] = "constant"
        self.assertAlmostEqual(ref.lr_at(9, 14, t), 1.0)


class ModelTest(RefTest):
    def test_tensor_names(self):
        m = ref.build_model(ref.load_spec(GPT_SPEC)[0])
        shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
        self.assertEqual(shapes["wte.weight"], (256, 64))
        self.assertEqual(shapes["h.1.attn.c_attn.weight"], (64, 192))
        self.assertEqual(shapes["h.1.mlp.c_proj.weight"], (256, 64))
        self.assertNotIn("lm_head.weight", shapes)
        self.assertEqual(len(shapes), 2 + 2 * 12 + 2)
        m = ref.build_model(ref.load_spec(LLAMA_SPEC)[0])
        shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
        self.assertEqual(shapes["model.layers.0.self_attn.k_proj.weight"], (32, 64))
        self.assertEqual(shapes["model.layers.0.self_attn.o_proj.weight"], (64, 64))
        self.assertEqual(shapes["model.layers.1.mlp.down_proj.weight"], (64, 172))
        self.assertEqual(shapes["lm_head.weight"], (256, 64))
        self.assertEqual(len(shapes), 1 + 2 * 9 + 1 + 1)

    def test_gpt_init_loss_is_log_vocab(self):
        model, mcfg, tcfg = self.init_model(GPT_SPEC)
        x, y = ref.get_batch(ref.load_tokens(self.random_tokens()), 0, 8, 64)
        with torch.no_grad():
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))
        self.assertLess(abs(loss.item() - math.log(256)), 0.05)

    def test_rope_matches_complex_rotation(self):
        T, D, theta = 16, 8, 500.0
        q = torch.randn(2, 3, T, D, dtype=torch.float64)
        cos, sin = ref.rope_cos_sin(T, D, theta, torch.float64)
        got = ref.apply_rope(q, cos, sin)
        # Pair (j, j + D/2) is a complex number rotated by pos * theta^(-2j/D).
        half = D // 2
        z = torch.complex(q[..., :half], q[..., half:])
        ang = torch.tensor([[p * theta ** (-2.0 * j / D) for j in range(half)]
                            for p in range(T)], dtype=torch.float64)
        z = z * torch.polar(torch.ones_like(ang), ang)
        want = torch.cat([z.real, z.imag], dim=-1)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)

    def test_gqa_equals_expanded_mha(self):
        torch.manual_seed(0)
        gqa = ref.build_model(ref.load_spec(LLAMA_SPEC)[0]).double()
        spec = json.loads(json.dumps(LLAMA_SPEC))
        spec["model"]["kv_heads"] = 4
        mha = ref.build_model(ref.load_spec(spec)[0]).double()
        sd = {}
        for n, p in gqa.named_parameters():
            if n.endswith(("k_proj.weight", "v_proj.weight")):
                # [Hkv*D, C] -> each kv head repeated for 2 consecutive query heads.
                p = p.view(2, 16, 64).repeat_interleave(2, dim=0).reshape(64, 64)
            sd[n] = p.detach()
        mha.load_state_dict(sd)
        x = torch.randint(0, 256, (2, 64))
        with torch.no_grad():
            torch.testing.assert_close(gqa(x), mha(x), rtol=1e-10, atol=1e-10)

    def test_causality(self):
        for spec in (GPT_SPEC, LLAMA_SPEC):
            model, _, _ = self.init_model(spec, torch.float64)
            x = torch.randint(0, 256, (1, 64))
            x2 = x.clone()
            x2[0, 40:] = (x2[0, 40:] + 7) % 256
            with torch.no_grad():
                torch.testing.assert_close(model(x)[:, :40], model(x2)[:, :40])


class TrainingTest(RefTest):
    def test_float32_matches_float64(self):
        data = ref.load_tokens(self.random_tokens())
        for spec in (GPT_SPEC, LLAMA_SPEC):
            res = {}
            for dt in (torch.float32, torch.float64):
                model, mcfg, tcfg = self.init_model(spec, dt)
                res[dt] = ref.train(model, data, mcfg, tcfg, 5)
            for k in ("losses", "grad_norm"):
                np.testing.assert_allclose(res[torch.float32][k], res[torch.float64][k],
                                           rtol=1e-4, err_msg=spec["model"]["family"] + k)

    def test_loss_falls_on_repetitive_data(self):
        p = self.path("rep.bin")
        ref.write_tokens(p, np.tile(np.arange(0, 200, 7), 200))
        spec = json.loads(json.dumps(GPT_SPEC))
        spec["train"]["optimizer"] = {"lr": 3e-3}
        spec["train"]["lr_schedule"] = {"decay": "constant"}
        model, mcfg, tcfg = self.init_model(spec)
        res = ref.train(model, ref.load_tokens(p), mcfg, tcfg, 25)
        self.assertLess(res["losses"][-1], 0.3 * res["losses"][0], res["losses"])

    def test_cli(self):
        spec_path = self.path("llama.json")
        with open(spec_path, "w") as f:
            json.dump(LLAMA_SPEC, f)
        script = os.path.join(HERE, "torch_reference.py")
        init, final, out = self.path("i.st"), self.path("f.st"), self.path("out.json")
        data = self.random_tokens(uint32=True)
        py = sys.executable
        subprocess.run([py, script, "--spec", spec_path, "--write-init", init], check=True)
        subprocess.run([py, script, "--spec", spec_path, "--init-from", init, "--data", data,
                        "--steps", "3", "--out", out, "--save-final", final, "--threads", "2",
                        "--quiet"], check=True)
        with open(out) as f:
            res = json.load(f)
        self.assertEqual(sorted(res), ["grad_norm", "losses", "lr"])
        self.assertEqual(len(res["losses"]), 3)
        w0, w1 = safetensors_io.load_file(init), safetensors_io.load_file(final)
        self.assertEqual(sorted(w0), sorted(w1))
        self.assertTrue(all(a.dtype == np.float32 for a in w1.values()))
        np.testing.assert_array_equal(w0["model.norm.weight"], np.ones(64, np.float32))
        self.assertGreater(np.abs(w0["lm_head.weight"] - w1["lm_head.weight"]).max(), 0)
        # Same run in-process reproduces the CLI losses exactly.
        model, mcfg, tcfg = self.init_model(LLAMA_SPEC)
        ref.load_weights(model, init)
        again = ref.train(model, ref.load_tokens(data), mcfg, tcfg, 3)
        self.assertEqual(again["losses"], res["losses"])


if __name__ == "__main__":
    unittest.main()
