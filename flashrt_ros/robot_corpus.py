"""
The default model's training data: conversations with a tabletop robot arm, from a grammar.

A scene is a few coloured objects, each on the table or in one of the places; the system
prompt describes it. The user gives instructions ("pick up the red cup and put it on the left
tray"), asks where things are, corrects the last instruction or cancels it; the assistant
answers an instruction with a confirmation and a short numbered plan that names the object
and the place, asks back when the instruction names a kind the scene holds twice, and says
so when the object is not there. Every conversation is a list of (role, content) messages,
drawn from a seeded `random.Random`, so the corpus is reproducible.

Some (colour, kind, place) combinations are held out: no instruction in the training
conversations moves that object to that place (`is_heldout`); `heldout_tasks` draws scenes
and instructions for them to measure whether the model generalises.
"""

from __future__ import annotations

import hashlib
import random

COLOURS = ('red', 'blue', 'green', 'yellow', 'white', 'black')
KINDS = ('cup', 'block', 'ball', 'bowl', 'can', 'sponge')
PLACES = ('left tray', 'right tray', 'bin', 'shelf', 'plate', 'box')
_IN = ('bin', 'box')  # 'in the bin'; the other places are 'on the ...'
INSTRUCTIONS = (
    'pick up the {o} and put it {at}', 'put the {o} {at}', 'move the {o} to the {p}',
    'place the {o} {at}', 'can you put the {o} {at}?', 'please move the {o} to the {p}',
    'take the {o} to the {p}', 'grab the {o} and place it {at}',
)
AMBIGUOUS = ('pick up the {k} and put it {at}', 'put the {k} {at}', 'move the {k} to the {p}')
WHERE = ('where is the {o}?', 'where is the {o} now?', 'where did you see the {o}?')
LOOK = ('what do you see?', 'what can you see?', 'which objects are there?')
CANCEL = ('stop', 'cancel that', 'never mind', 'stop, cancel it', 'wait, cancel')
HELDOUT_EVERY = 7  # about one (colour, kind, place) combination in 7 is held out


def at(place: str) -> str:
    """Return the place with its preposition: 'on the left tray', 'in the bin'."""
    return f'{"in" if place in _IN else "on"} the {place}'


def is_heldout(obj: str, place: str) -> bool:
    """Return whether moving `obj` ('red cup') to `place` is kept out of the training data."""
    digest = hashlib.sha256(f'{obj}|{place}'.encode()).hexdigest()
    return int(digest, 16) % HELDOUT_EVERY == 0


def plan(obj: str, place: str, head: str = 'OK') -> str:
    """Return the assistant's confirmation and numbered plan for one pick-and-place."""
    return (f'{head}: the {obj} to the {place}.\n1. Reach the {obj}.\n2. Grasp the {obj}.\n'
            f'3. Move to the {place}.\n4. Place it {at(place)}.\n5. Release and go home.')


def scene(rng: random.Random, n_objects: int | None = None) -> dict[str, str]:
    """Return {object: where} for a few distinct objects ('table' or a place)."""
    n = n_objects or rng.randint(3, 5)
    objects = set()
    while len(objects) < n:
        objects.add(f'{rng.choice(COLOURS)} {rng.choice(KINDS)}')
    return {o: ('table' if rng.random() < 0.6 else rng.choice(PLACES))
            for o in sorted(objects, key=lambda _: rng.random())}


def system_prompt(objects: dict[str, str]) -> str:
    """Describe the scene: every object and where it is, and the places the arm can use."""
    where = ', '.join(f'{o} ({w})' for o, w in objects.items())
    return (f'You are a tabletop robot arm. Objects: {where}. '
            f'Places: {", ".join(PLACES)}.')


def _where(obj: str, objects: dict[str, str]) -> str:
    w = objects[obj]
    return 'on the table' if w == 'table' else at(w)


def _listing(names) -> str:
    names = [f'the {n}' for n in names]
    return names[0] if len(names) == 1 else ', '.join(names[:-1]) + ' and ' + names[-1]


def _cap(text: str, rng: random.Random) -> str:
    return text[0].upper() + text[1:] if rng.random() < 0.5 else text


def instruction(obj: str, place: str, rng: random.Random) -> str:
    """Return one phrasing of 'move obj to place'."""
    return _cap(rng.choice(INSTRUCTIONS).format(o=obj, p=place, at=at(place)), rng)


def _target(objects, rng, training):
    """Pick an (object in the scene, place) pair; never a held-out one when training."""
    while True:
        obj, place = rng.choice(list(objects)), rng.choice(PLACES)
        if not (training and is_heldout(obj, place)):
            return obj, place


def conversation(rng: random.Random, training: bool = True) -> list[tuple[str, str]]:
    """Return one conversation: a system prompt and one to three exchanges."""
    objects = scene(rng)
    messages = [('system', system_prompt(objects))]
    last = None  # the (object, place) of the last plan
    for _ in range(rng.choice((1, 1, 2, 2, 3))):
        r = rng.random()
        if last and r < 0.15:  # a different object for the same place
            others = [o for o in objects if o != last[0]]
            obj = rng.choice(others)
            if training and is_heldout(obj, last[1]):
                continue
            user = rng.choice((f'no, the {obj}', f'sorry, I meant the {obj}',
                               f'not that one, the {obj}'))
            last = (obj, last[1])
            reply = plan(obj, last[1], head='OK, instead')
        elif last and r < 0.3:  # the same object, another place
            place = rng.choice([p for p in PLACES if p != last[1]])
            if training and is_heldout(last[0], place):
                continue
            user = rng.choice((f'no, put it {at(place)}', f'actually, to the {place}',
                               f'change of plan: {at(place)}'))
            last = (last[0], place)
            reply = plan(last[0], place, head='OK, instead')
        elif last and r < 0.38:
            user, reply, last = rng.choice(CANCEL), f'Cancelled. The {last[0]} stays put.', None
        elif r < 0.5:
            obj = rng.choice(list(objects))
            user = _cap(rng.choice(WHERE).format(o=obj), rng)
            reply = f'The {obj} is {_where(obj, objects)}.'
        elif r < 0.56:
            user = _cap(rng.choice(LOOK), rng)
            reply = f'I see {_listing(objects)}.'
        elif r < 0.62:  # an object that is not in the scene
            while True:
                obj = f'{rng.choice(COLOURS)} {rng.choice(KINDS)}'
                if obj not in objects:
                    break
            user = instruction(obj, rng.choice(PLACES), rng)
            reply = f'I cannot see a {obj}. I see {_listing(objects)}.'
        elif r < 0.72 and _ambiguous_kind(objects):  # a kind the scene holds twice
            kind = _ambiguous_kind(objects)
            same = [o for o in objects if o.endswith(' ' + kind)]
            place = rng.choice(PLACES)
            user = _cap(rng.choice(AMBIGUOUS).format(k=kind, p=place, at=at(place)), rng)
            reply = f'Which {kind} do you mean: {_listing(same).replace(" and ", " or ")}?'
            messages += [('user', user), ('assistant', reply)]
            obj = rng.choice(same)
            if training and is_heldout(obj, place):
                return messages
            user = rng.choice((f'the {obj}', f'the {obj.split()[0]} one'))
            last = (obj, place)
            reply = plan(obj, place)
        else:
            obj, place = _target(objects, rng, training)
            user, last = instruction(obj, place, rng), (obj, place)
            reply = plan(obj, place)
        messages += [('user', user), ('assistant', reply)]
    return messages


def _ambiguous_kind(objects) -> str | None:
    kinds = [o.split()[1] for o in objects]
    return next((k for k in kinds if kinds.count(k) > 1), None)


def heldout_tasks(n: int, seed: int) -> list[tuple[list[tuple[str, str]], str, str]]:
    """Return n (messages ending in a user instruction, object, place) on held-out pairs."""
    rng = random.Random(seed)
    pairs = [(f'{c} {k}', p) for c in COLOURS for k in KINDS for p in PLACES
             if is_heldout(f'{c} {k}', p)]
    tasks = []
    for i in range(n):
        obj, place = pairs[i % len(pairs)]
        objects = scene(rng)
        if obj not in objects:
            objects.popitem()
            objects[obj] = 'table'
            objects = dict(sorted(objects.items(), key=lambda _: rng.random()))
        messages = [('system', system_prompt(objects)), ('user', instruction(obj, place, rng))]
        tasks.append((messages, obj, place))
    return tasks


def plan_is_right(reply: str, obj: str, place: str) -> bool:
    """Return whether a reply names `obj` as its first object and `place` as its first place."""
    objects = [(reply.find(f'{c} {k}'), f'{c} {k}') for c in COLOURS for k in KINDS]
    places = [(reply.find(p), p) for p in PLACES]
    first_obj = min(((i, o) for i, o in objects if i >= 0), default=None)
    first_place = min(((i, p) for i, p in places if i >= 0), default=None)
    return (first_obj is not None and first_place is not None and first_obj[1] == obj
            and first_place[1] == place and first_obj[0] < first_place[0]
            and reply.count(obj) >= 2 and reply.count(place) >= 2)
