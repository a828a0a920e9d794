# Copyright (c) 2026 paddle_muon_ext Authors. All Rights Reserved.
# Licensed under the Apache License, Version 2.0.
"""Packaging: python/ is the package root so python/paddle_muon_ext/... maps
1:1 onto Paddle's python/paddle/... tree."""

from setuptools import find_packages, setup

setup(
    name="paddle_muon_ext",
    version="0.1.0",
    description="Sharded Muon optimizer and hierarchical EP communication for PaddlePaddle",
    license="Apache-2.0",
    package_dir={"": "python"},
    packages=find_packages("python"),
    python_requires=">=3.9",
    # No hard paddle dependency: a GPU node already has paddlepaddle-gpu and
    # must not get the CPU wheel pulled in. CPU boxes use the [cpu] extra.
    install_requires=["numpy"],
    extras_require={
        "cpu": ["paddlepaddle>=3.2,<3.4"],
        # plan --png draws with matplotlib; checked before any work
        "plot": ["matplotlib"],
        "test": ["pytest>=7", "pytest-mock", "coverage[toml]>=7", "matplotlib", "setuptools>=61", "wheel"],
    },
    entry_points={"console_scripts": ["paddle-muon-ext=paddle_muon_ext.cli:main"]},
)
