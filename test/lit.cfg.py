# lit configuration of Tessel's tests.
import os
import shutil
import subprocess

import lit.formats

config.name = "Tessel"
config.test_format = lit.formats.ShTest(execute_external=False)
config.suffixes = [".mlir", ".test"]
config.excludes = ["Inputs", "lit.cfg.py", "CMakeLists.txt"]
config.test_source_root = os.path.dirname(__file__)
config.test_exec_root = os.path.join(config.tessel_obj_root, "test")

bin_dir = os.path.join(config.tessel_obj_root, "bin")
config.environment["PATH"] = os.pathsep.join(
    [bin_dir, config.llvm_tools_dir, config.environment.get("PATH", os.environ["PATH"])])
# Generated programs are cached per test run, so each distinct program is built once.
config.environment["TESSEL_CACHE_DIR"] = os.path.join(config.test_exec_root, "program-cache")
# Small models run fastest and reproducibly on one thread.
config.environment["OMP_NUM_THREADS"] = "1"
config.environment["OPENBLAS_NUM_THREADS"] = "1"
for var in ["HOME", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"]:
    if var in os.environ:
        config.environment[var] = os.environ[var]

config.substitutions.append(("%src", config.tessel_src_root))
config.substitutions.append(("%examples", os.path.join(config.tessel_src_root, "examples")))
config.substitutions.append(("%python", "/usr/bin/python3"))
config.substitutions.append(("%obj", config.tessel_obj_root))

# PyTorch (Debian's python3-torch) is the independent reference for e2e tests.
try:
    subprocess.run(["/usr/bin/python3", "-c", "import torch"], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    config.available_features.add("torch")
except (OSError, subprocess.CalledProcessError):
    lit_config.warning("python3-torch not found: reference-comparison tests are skipped")

# test/e2e/slurm.test starts a one-node Slurm of its own (munged, slurmctld, slurmd).
if os.geteuid() == 0 and all(shutil.which(p) for p in ("munged", "slurmctld", "slurmd", "sbatch")):
    config.available_features.add("slurm")
else:
    lit_config.note("the Slurm launch test is skipped: it needs root and slurm-wlm, munge")

# test/e2e/checkpoint-full-disk.test fills a small tmpfs of its own: it needs
# root and a kernel that lets it mount one.
def can_mount_tmpfs():
    import tempfile
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    with tempfile.TemporaryDirectory() as where:
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", where],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode:
            return False
        subprocess.run(["umount", where])
    return True
if can_mount_tmpfs():
    config.available_features.add("tmpfs")
else:
    lit_config.note("the full-disk checkpoint test is skipped: it needs root and tmpfs mounts")

# Hugging Face transformers with a PyTorch it supports: the export test
# also loads its output with AutoModelForCausalLM.
try:
    subprocess.run(["/usr/bin/python3", "-c",
                    "from transformers import AutoModelForCausalLM, GPT2LMHeadModel"],
                   check=True, capture_output=True, timeout=120)
    config.available_features.add("transformers")
except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired):
    lit_config.note("transformers is not installed: the export test checks its "
                    "output with its own PyTorch forward only")

# A headless browser opens the run report (test/e2e/report.test), where
# one starts here.
try:
    page = subprocess.run(
        ["chromium", "--headless", "--no-sandbox", "--disable-gpu",
         "--disable-dev-shm-usage", "--dump-dom",
         "data:text/html,<p>tessel</p>"],
        capture_output=True, text=True, timeout=120).stdout
    if "<p>tessel</p>" not in page:
        raise OSError("no page")
    config.available_features.add("chromium")
except (OSError, subprocess.TimeoutExpired):
    lit_config.note("no headless chromium runs here: the report test does "
                    "not open its page in a browser")

# --target cuda compiles wherever Tessel was built with nvcc (no GPU needed);
# running CUDA programs needs a GPU.
if getattr(config, "tessel_cuda", 0):
    config.available_features.add("cuda")
    try:
        gpus = subprocess.run(["nvidia-smi", "-L"], check=True, text=True,
                              capture_output=True).stdout.count("GPU ")
        if gpus >= 1:
            config.available_features.add("gpu")
        # Multi-GPU layouts need one GPU per rank.
        for n in (2, 4, 8):
            if gpus >= n:
                config.available_features.add("gpus-%d" % n)
    except (OSError, subprocess.CalledProcessError):
        pass
