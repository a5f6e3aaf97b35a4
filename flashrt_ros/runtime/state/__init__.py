"""
The live state and its capsules; arena.py is the one owner of the state buffers.

  arena    StateArena: every state tensor as a view into one allocation per device
  capsule  Capsule, CapsuleInfo, names and tiers
  codec    capture / check / apply between the live state and a capsule (its metadata)
  ring     the rollback ring of committed boundaries and its retired entries
  store    CapsuleStore: named capsules per tier, budgets, eviction
  disk     the disk tier's file format and I/O
  memory   where blobs live: device, pinned or pageable host memory, the CPU blob pool
"""
