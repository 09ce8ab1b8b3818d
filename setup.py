from pathlib import Path

from setuptools import find_packages, setup

TEST_REQUIREMENTS = Path(__file__).parent / "tests" / "requirements.txt"

setup(
    name="poot",
    version="0.1.0",
    description="LLM inference and an OpenAI-compatible server on the vendors' own GPU drivers",
    python_requires=">=3.10",
    packages=find_packages(include=["poot", "poot.*", "drivers", "drivers.*"]),
    install_requires=["numpy", "cffi"],
    extras_require={
        "wgpu": ["wgpu"],   # only as the carrier of the wgpu-native library
        "test": [line.strip() for line in TEST_REQUIREMENTS.read_text().splitlines()
                 if line.strip() and not line.startswith("#")] if TEST_REQUIREMENTS.exists() else [],
    },
    entry_points={"console_scripts": ["poot=poot.cli:main", "poot-serve=poot.serve.cli:main"]},
)
