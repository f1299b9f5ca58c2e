"""What a home can hold: object types, receptacle types, room types and the six goal kinds (data only).

The tables follow ALFWorld's vocabulary (``countertop``, ``sinkbasin``, ``desklamp``, ...). An object type
belongs to one category; a receptacle type accepts categories (or named object types), and the generator
places objects only where they are accepted. The planner reads the same tables: knowing that mugs are
not kept in the toilet is common sense an agent may use when it searches.
"""

from __future__ import annotations

#: The six goal kinds, in ALFWorld's names.
PICK_AND_PLACE = "pick_and_place"
LOOK_IN_LIGHT = "look_at_obj_in_light"
CLEAN_AND_PLACE = "pick_clean_then_place"
HEAT_AND_PLACE = "pick_heat_then_place"
COOL_AND_PLACE = "pick_cool_then_place"
PICK_TWO = "pick_two_obj_and_place"
GOAL_KINDS = (PICK_AND_PLACE, LOOK_IN_LIGHT, CLEAN_AND_PLACE, HEAT_AND_PLACE, COOL_AND_PLACE, PICK_TWO)

#: Goal kind -> (object state the goal asks for, the command that gives it, the receptacle type that is its tool).
TRANSFORMS = {
    CLEAN_AND_PLACE: ("clean", "clean", "sinkbasin"),
    HEAT_AND_PLACE: ("hot", "heat", "microwave"),
    COOL_AND_PLACE: ("cool", "cool", "fridge"),
}

#: The lamp: an object that stands on a receptacle, cannot be taken, and is switched with ``use``.
LAMP = "desklamp"
#: Receptacle types a lamp stands on.
LAMP_HOSTS = ("desk", "sidetable", "dresser")

#: Object type -> (category, what can be done to it: c = clean, h = heat, k = cool, l = examine in light).
ITEMS: dict[str, tuple[str, str]] = {
    "apple": ("food", "chk"), "tomato": ("food", "chk"), "potato": ("food", "chk"), "lettuce": ("food", "ck"),
    "egg": ("food", "hk"), "bread": ("food", "hk"),
    "mug": ("dish", "chk"), "cup": ("dish", "chk"), "plate": ("dish", "chk"), "bowl": ("dish", "chk"),
    "fork": ("utensil", "c"), "spoon": ("utensil", "c"), "knife": ("utensil", "c"), "spatula": ("utensil", "c"),
    "pan": ("cookware", "ck"), "pot": ("cookware", "ck"),
    "cellphone": ("gadget", "l"), "remotecontrol": ("gadget", "l"), "keychain": ("gadget", "l"),
    "creditcard": ("gadget", "l"), "alarmclock": ("gadget", "l"), "watch": ("gadget", "l"), "cd": ("gadget", "l"),
    "book": ("reading", "l"), "pen": ("reading", "l"), "pencil": ("reading", "l"), "newspaper": ("reading", "l"),
    "vase": ("decor", "l"), "statue": ("decor", "l"), "candle": ("decor", "l"),
    "soapbar": ("toiletry", "c"), "soapbottle": ("toiletry", ""), "spraybottle": ("toiletry", ""),
    "cloth": ("toiletry", "c"), "toiletpaper": ("toiletry", ""),
    "pillow": ("bedding", ""),
}
_IRREGULAR_PLURALS = {
    "tomato": "tomatoes", "potato": "potatoes", "knife": "knives", "watch": "watches",
    "lettuce": "heads of lettuce", "bread": "loaves of bread",
}
#: Object type -> its plural, as goals write it ("put two cds in a drawer.").
PLURALS = {name: _IRREGULAR_PLURALS.get(name, name + "s") for name in ITEMS}

#: Receptacle type -> (opens and closes, what it accepts: categories or object types, "in" or "on").
RECEPTACLES: dict[str, tuple[bool, frozenset[str], str]] = {
    "countertop": (False, frozenset({"food", "dish", "utensil", "cookware", "gadget", "toiletry"}), "on"),
    "diningtable": (False, frozenset({"food", "dish", "utensil", "gadget", "reading", "decor"}), "on"),
    "cabinet": (True, frozenset({"dish", "utensil", "cookware", "toiletry"}), "in"),
    "drawer": (True, frozenset({"utensil", "gadget", "reading"}), "in"),
    "fridge": (True, frozenset({"food", "dish"}), "in"),
    "microwave": (True, frozenset({"food", "dish"}), "in"),
    "sinkbasin": (False, frozenset({"food", "dish", "utensil"}), "in"),
    "stoveburner": (False, frozenset({"cookware"}), "on"),
    "coffeemachine": (False, frozenset({"mug", "cup"}), "in"),
    "garbagecan": (False, frozenset({"food", "reading"}), "in"),
    "shelf": (False, frozenset({"dish", "gadget", "reading", "decor", "toiletry"}), "on"),
    "sofa": (False, frozenset({"gadget", "reading", "bedding"}), "on"),
    "armchair": (False, frozenset({"gadget", "reading", "bedding"}), "on"),
    "coffeetable": (False, frozenset({"gadget", "reading", "decor"}), "on"),
    "sidetable": (False, frozenset({"gadget", "reading", "decor"}), "on"),
    "tvstand": (False, frozenset({"gadget", "decor"}), "on"),
    "desk": (False, frozenset({"gadget", "reading", "decor"}), "on"),
    "dresser": (False, frozenset({"gadget", "reading", "decor"}), "on"),
    "bed": (False, frozenset({"gadget", "reading", "bedding"}), "on"),
    "safe": (True, frozenset({"gadget"}), "in"),
    "toilet": (False, frozenset({"toiletry"}), "on"),
    "bathtubbasin": (False, frozenset({"toiletry"}), "in"),
}

#: Room type -> (receptacle types it always has, types it may have: each one drawn with probability 1/2).
ROOMS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "kitchen": (("countertop", "fridge", "microwave", "sinkbasin", "stoveburner", "cabinet", "drawer"),
                ("coffeemachine", "diningtable", "garbagecan", "shelf", "cabinet", "drawer")),
    "living room": (("sofa", "coffeetable", "sidetable", "tvstand"), ("armchair", "shelf", "drawer", "garbagecan")),
    "bedroom": (("bed", "dresser", "sidetable"), ("desk", "shelf", "drawer", "safe", "garbagecan")),
    "bathroom": (("sinkbasin", "toilet", "bathtubbasin", "countertop"), ("cabinet", "shelf", "garbagecan")),
    "office": (("desk", "shelf", "drawer"), ("sidetable", "safe", "armchair", "garbagecan")),
    "hallway": (("shelf", "sidetable"), ("dresser", "drawer", "cabinet")),
}
#: Rooms with a desklamp (each such room has one, on one of its LAMP_HOSTS).
LAMP_ROOMS = ("living room", "bedroom", "office")
#: Goal kind -> the room types one of which a home must have for the goal (its tool or lamp is there).
ANCHOR_ROOMS = {
    PICK_AND_PLACE: tuple(ROOMS),
    PICK_TWO: tuple(ROOMS),
    LOOK_IN_LIGHT: LAMP_ROOMS,
    CLEAN_AND_PLACE: ("kitchen", "bathroom"),
    HEAT_AND_PLACE: ("kitchen",),
    COOL_AND_PLACE: ("kitchen",),
}


def accepts(receptacle_type: str, item_type: str) -> bool:
    """Whether objects of ``item_type`` are kept in (or on) receptacles of ``receptacle_type``."""
    wanted = RECEPTACLES[receptacle_type][1]
    return item_type in wanted or ITEMS[item_type][0] in wanted


def can(item_type: str, ability: str) -> bool:
    """Whether ``item_type`` can be cleaned (``c``), heated (``h``), cooled (``k``) or examined in light (``l``)."""
    return ability in ITEMS[item_type][1]


#: Goal kind -> the ability its object must have.
GOAL_ABILITY = {LOOK_IN_LIGHT: "l", CLEAN_AND_PLACE: "c", HEAT_AND_PLACE: "h", COOL_AND_PLACE: "k"}
