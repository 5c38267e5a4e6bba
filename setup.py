"""Installs the ``modules`` (user API) and ``functions`` (math and synchronization) packages.

The compiled CPU and CUDA kernels (``src/``) join this build as a torch cpp_extension; until then
the pure-PyTorch reference kernels serve every device.
"""
from setuptools import setup

setup(
    name="syncbn",
    version="0.1.0",
    description="Synchronized batch normalization for nn.DataParallel, threads and one device",
    packages=["functions", "modules"],
    python_requires=">=3.9",
    install_requires=["torch>=2.4"],
)
