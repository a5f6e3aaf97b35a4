"""The ROS 2 shell: the `flashrt` lifecycle node and its executable (rclpy only here)."""

from .main import main
from .node import FlashRTNode, NODE_NAME

__all__ = ['FlashRTNode', 'NODE_NAME', 'main']
