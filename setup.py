"""Plain-Python install of the ROS-free runtime: `pip install -e .`.

The ROS 2 build (interfaces, node, launch files) goes through CMakeLists.txt with
colcon; this file only serves users who want `flashrt_ros.runtime` without ROS.
"""

from setuptools import find_packages, setup

setup(
    name='flashrt_ros',
    version='0.1.0',
    description='Execution-state capsules for low-latency hybrid-model inference',
    license='Apache-2.0',
    packages=find_packages(include=['flashrt_ros', 'flashrt_ros.*']),
    # The trained default model (`model: default`): a checkpoint folder inside the package;
    # the compiled CPU step's C source, built at first use.
    package_data={'flashrt_ros': ['models/default/*', 'models/act-arm/*', 'runtime/models/*.c']},
    python_requires='>=3.10',
    # torch is deliberately loose here: install the build that fits the machine (CPU, CUDA,
    # JetPack) first; `make setup` pins the CPU build. The CUDA path (graph capture, pinned
    # and device capsules) is written for torch 2.12 to 2.13; on an older torch a CUDA
    # runtime decodes eagerly (engine.MIN_GRAPH_TORCH) and the 'cuda' extra asks for it.
    install_requires=['torch>=2.4', 'transformers>=5.24,<6', 'safetensors', 'numpy', 'pyyaml'],
    extras_require={'bench': ['matplotlib'], 'cuda': ['torch>=2.12,<2.14']},
    entry_points={'console_scripts': ['flashrt_node = flashrt_ros.node:main']},
)
