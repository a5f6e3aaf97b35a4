"""Execution-state capsules for low-latency inference, with a ROS 2 shell."""
