"""Package definition for tfremat."""

from setuptools import find_packages, setup

setup(
    name="tfremat",
    version="0.1.0",
    description="Optimal rematerialization (activation recomputation) for TensorFlow/Keras training",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["tfremat", "tfremat.*"]),
    install_requires=[
        "numpy>=1.24",
        "networkx>=3.0",
        "absl-py>=1.0",
        # 1.16.0 (November 2026) gave a costlier schedule on the benchmark's ResNet50 case at
        # 1.1x its smallest feasible budget (1.05735x against 1.15.1's 1.05525x, same seed,
        # 60 s) and overran a 60 s limit by 4 s at 80%; the README's solver tables are 1.15's.
        "highspy>=1.15,<1.16",
    ],
    # TensorFlow is an extra so that the planning core installs without it and users pick
    # their build: "tensorflow" (GPU-capable) or "cpu" (tensorflow-cpu, smaller).
    extras_require={
        "tensorflow": ["tensorflow>=2.16"],
        "cpu": ["tensorflow-cpu>=2.16"],
        "test": ["pytest>=7", "hypothesis>=6", "pytest-xdist>=3"],
        "plots": ["matplotlib>=3.7"],
        "examples": ["scikit-learn>=1.3"],
        "gurobi": ["gurobipy"],
    },
    entry_points={"console_scripts": ["tfremat=tfremat.cli:run"]},
)
