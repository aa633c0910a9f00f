"""Synthetic stories: a grammar over settings, characters, animals, weather, objects, food,
emotions, actions, dialogue and morals (train/story_concepts.py). Every story carries the exact
set of story concepts whose words it wrote.

Deterministic: story `i` of seed `s` depends only on (s, i), never on how many processes
generate, so shards can be made in parallel and reproduced one by one. Stdlib only (runs on the
GPU machine).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from train.story_concepts import ACTIONS, ANIMALS, BY_NAME, CHARACTERS, EMOTIONS, FOODS, MORALS, OBJECTS, SETTINGS, WEATHER

NAMES = (
    "Pip Milo Luna Tilly Oscar Rosie Finn Hazel Leo Poppy Max Ivy Sam Ruby Toby Jack Mia Ben Lily Theo Zoe "
    "Noah Ella Alfie Nora Ollie Maya Jasper Clara Felix Iris Hugo Wren Arlo Sadie Otis Mabel Rory Elsie Ezra Freya "
    "Kit Juno Basil Willa Rufus Greta Ned Hattie Percy Lottie Reuben Tess Silas Edie Archie Bea Cosmo Pearl Dot "
    "Ziggy Bram Lulu Olive Pepper Biscuit Nutmeg Bramble Clover Maple Willow Sky Ash Rowan Quill "
    "Tansy Barnaby Winnie Ronan Esme Cleo Marigold Pippin Hamish Orla Dilly Nico Suki Kai Anya Omar Priya Tomas "
    "Amara Yusuf Leila Ravi Sofia Mateo Ines Kofi Nia Jun Mei Aiko Lars Ingrid Pablo Rosa Dmitri Vera Emeka Zara"
).split()
ADJ_LOOK = "little,small,tiny,young,old,clever,gentle,quiet,busy,bright,careful,playful,sleepy,wise,silly,quick,clumsy,cheeky".split(",")
ADJ_THING = "old,shiny,golden,silver,red,blue,green,tiny,huge,strange,dusty,broken,beautiful,magic,wooden,striped,heavy,soft".split(",")
TIMES = ("One morning", "One evening", "One afternoon", "Early one day", "Late one night", "At dawn", "One autumn day",
         "One spring morning", "One winter evening", "On a summer day", "The next day", "Just after breakfast",
         "Before lunch", "After supper")
CONNECT = ("Then", "After that", "Soon", "Before long", "Next", "A little later", "All of a sudden", "Just then",
           "Meanwhile", "At last", "Later")


# Grammar 2: narration sentences (not the first, no quotes) may get a lead-in and a tail drawn from
# these, multiplying the distinct sentences (grammar 1: 36 % of sentences distinct over 20,000
# stories). They spell no story-concept word in any form (the exact-tags test checks).
LEADS = ("And ", "So ", "Well, ", "That day, ", "By then, ", "For a moment, ", "Without a word, ", "As usual, ",
         "Once again, ", "In no time, ", "Of course, ", "To nobody's surprise, ", "Little by little, ",
         "Right away, ", "Sure enough, ", "Just like that, ", "For the first time, ", "As always, ")
TAILS = (" for a while", " for a long time", " all afternoon", " once more", " without a fuss", " in a flash",
         " with a grin", " with a sigh", " before anyone noticed", " without looking back", " one step at a time",
         " like never before", " again and again", " at the very same moment", " as the day went on",
         " while the others watched", " as if by magic", " in the blink of an eye", " for no reason at all",
         " just in time", " bit by bit", " after a long pause")
GRAMMARS = (1, 2)
SPEECH_MANNERS = ("softly", "with a smile", "from the path", "in a small voice", "loudly", "at once", "quietly",
                  "from far away", "with a nod", "a little out of breath", "in a hurry", "without stopping",
                  "from behind a rock", "with a puzzled look", "in a low voice", "with a friendly nod")
QUESTIONS = ("What is that {obj}?", "What is that {adj} {obj}?", "Where did you find that {obj}?",
             "Is that {adj} {obj} yours?", "Can I see the {obj}?", "What will you do with the {obj}?",
             "Why do you have {article_obj}?", "Is that really {article_obj}?", "Who gave you the {adj} {obj}?",
             "Have you ever seen {article_obj} like that?")


def addressed(story: "Story", sentence: str, who: str) -> str:
    """Grammar 2: a reply that names the one it answers ('"Of course, Pip," said Jack.'), when its
    quote ends with a comma; grammar 1: unchanged."""
    head, sep, rest = sentence.partition(',"')
    if story.grammar < 2 or not sep or head.count('"') != 1:
        return sentence
    return f'{head}, {who},"{rest}'


@dataclass
class Story:
    """One story under construction: its sentences and the story concepts it used."""

    rng: random.Random
    sentences: list[str] = field(default_factory=list)
    concepts: set[str] = field(default_factory=set)
    prompt: str = ""
    grammar: int = 1

    def word(self, concept: str, plural: bool = False) -> str:
        """A word of `concept`, recorded in the story's tags."""
        self.concepts.add(concept)
        w = self.rng.choice(BY_NAME[concept].words)
        return pluralize(w) if plural else w

    def pick(self, concept: str, options: tuple[str, ...]) -> str:
        """One of `options` (words of `concept`), recorded in the story's tags."""
        self.concepts.add(concept)
        return self.rng.choice(options)

    def say(self, sentence: str, vary: bool = True) -> None:
        """Add a sentence. Grammar 2 may give it a lead-in (not the opening, nor a sentence that
        starts with one or with speech) and a tail (before a final full stop), unless not `vary`."""
        if vary and self.grammar >= 2:
            sentence = self._vary(sentence)
        self.sentences.append(sentence[0].upper() + sentence[1:])

    def _vary(self, sentence: str) -> str:
        rng = self.rng
        first = sentence.split(" ", 1)[0]
        if (self.sentences and rng.random() < 0.5 and (first in NAMES or first.islower())
                and first not in ("but", "and", "so", "when", "at", "in", "from", "the", "every", "beyond")):
            sentence = rng.choice(LEADS) + sentence
        if rng.random() < 0.8 and sentence.endswith("."):
            sentence = sentence[:-1] + rng.choice(TAILS) + "."
        return sentence

    @property
    def text(self) -> str:
        return " ".join(self.sentences)


_PLURALS = {"mouse": "mice", "wolf": "wolves", "sheep": "sheep", "deer": "deer", "calf": "calves", "loaf": "loaves",
            "fisherman": "fishermen", "cactus": "cacti"}


def pluralize(word: str) -> str:
    if word in _PLURALS:
        return _PLURALS[word]
    if word.endswith(("s", "x", "z", "ch", "sh")):
        return word + "es"
    if word.endswith("y") and word[-2:-1] not in "aeiou":
        return word[:-1] + "ies"
    return word + "s"


def article(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


# ---- actions: phrases in the past tense, the concept's words written through {w:NAME}


ACTION_PHRASES: dict[str, tuple[str, ...]] = {
    "swimming": ("swam in the cool water", "splashed about for a while", "paddled in the shallow water",
                 "swam a long way and back"),
    "climbing": ("climbed as high as {p} could", "scrambled up over the rocks", "climbed to the very top"),
    "running": ("ran as fast as {p} could", "raced all the way back", "dashed off with a shout", "ran in circles"),
    "flying": ("flew high above everything", "soared over the treetops", "fluttered from side to side"),
    "digging": ("dug a deep hole", "dug and dug until {p} found something", "burrowed into the soft ground"),
    "singing": ("sang a merry tune", "hummed a little song", "sang loudly to everyone", "sang a song about home"),
    "dancing": ("danced until the sun went down", "twirled around and around", "danced a funny little dance"),
    "building": ("built a small house", "built a tall pile of sticks", "constructed a clever bridge"),
    "cooking": ("cooked a warm meal", "baked something sweet", "stirred a big pot"),
    "reading": ("read a long story aloud", "read every page twice", "opened a storybook and read"),
    "painting": ("painted a picture of the sky", "painted bright colors everywhere", "picked up a paintbrush"),
    "sailing": ("sailed across the water", "sailed away across the water", "took the oars and sailed on"),
    "exploring": ("explored every corner", "wandered far from home", "roamed around to see what was there"),
    "hiding": ("hid behind a big rock", "hid and waited quietly", "peeked out from a hiding place"),
    "jumping": ("jumped over a log", "hopped from stone to stone", "leapt into the air"),
    "sliding": ("slid down the icy hill", "glided along the ice", "slid all the way to the bottom"),
}
# The phrases above spell concept words directly (swam, climbed, ...): check that they only
# use the words of their own action (tests do, through the labeler).

# Forms of the moral concepts (subsets of their words) for the closing line.
MORAL_FORMS: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {  # (adjectives, nouns, verbs)
    "kindness": (("kind",), ("kindness",), ()), "honesty": (("honest",), ("honesty", "truth"), ()),
    "sharing": ((), ("sharing",), ("share",)), "courage": (("brave",), ("courage", "bravery"), ()),
    "patience": (("patient",), ("patience",), ()), "friendship": ((), ("friendship",), ()),
    "perseverance": ((), ("perseverance", "persistence"), ()),
    "gratitude": (("grateful", "thankful"), ("gratitude",), ()), "forgiveness": ((), ("forgiveness",), ("forgive",)),
    "teamwork": ((), ("teamwork",), ("cooperate",)), "curiosity": (("curious",), ("curiosity",), ()),
    "humility": (("humble",), ("humility",), ()), "generosity": (("generous",), ("generosity",), ()),
}
MORAL_ADJ_LINES = ("it is good to be {x}", "being {x} is worth more than gold", "a {x} heart is a light heart",
                   "it is always better to be {x}", "the world needs more {x} hearts")
MORAL_NOUN_LINES = ("{x} is worth more than gold", "a little {x} goes a long way", "{x} makes every day brighter",
                    "{x} is the best gift of all", "{x} always comes back to you", "there is nothing better than {x}")
MORAL_VERB_LINES = ("it is good to {x}", "we should always {x} when we can", "those who {x} are never poor")

# Forms of the emotion concepts: adjectives after "felt", nouns after "full of".
EMOTION_ADJ: dict[str, tuple[str, ...]] = {
    "joy": ("happy", "glad", "joyful", "cheerful", "delighted"), "sadness": ("sad", "unhappy", "gloomy", "tearful", "sorrowful"),
    "fear": ("afraid", "scared", "frightened", "fearful", "terrified"), "anger": ("angry", "furious", "grumpy", "annoyed"),
    "surprise": ("surprised", "amazed", "astonished"), "love": ("loving",), "pride": ("proud",),
    "loneliness": ("lonely",), "hope": ("hopeful",), "worry": ("worried", "nervous", "anxious"),
    "calm": ("calm", "peaceful", "relaxed"), "excitement": ("excited", "thrilled", "eager"),
    "shyness": ("shy", "timid", "bashful"),
}
EMOTION_NOUN: dict[str, tuple[str, ...]] = {"love": ("love", "affection"), "pride": ("pride",),
                                            "loneliness": ("loneliness",), "hope": ("hope",)}

# Weather sentences spell their concept's words directly.
WEATHER_LINES: dict[str, tuple[str, ...]] = {
    "rain": ("it began to rain", "rain fell softly on the roof", "a light drizzle was falling",
             "there were puddles everywhere", "raindrops tapped on the window"),
    "snow": ("snow covered the ground", "snowflakes drifted down", "a blizzard blew in from the north",
             "a snowman stood by the door", "fresh snow lay all around"),
    "wind": ("the wind was blowing hard", "a cool breeze came through", "a gust of wind shook the door",
             "the wind whistled all day"),
    "storm": ("a storm was coming", "thunder rumbled far away", "lightning flashed across the sky",
              "a great storm shook the sky"),
    "sunshine": ("the sunshine was warm and golden", "it was a sunny day", "a sunbeam lit up the ground",
                 "warm sunshine filled the air"),
    "fog": ("a thick fog covered everything", "mist hung in the air", "it was a foggy day", "the fog was grey and cold"),
    "rainbow": ("a rainbow stretched across the sky", "a rainbow appeared after the shower",
                "there was a rainbow over the hills"),
    "cloud": ("big clouds drifted by", "the sky was cloudy and grey", "a dark cloud covered the sky"),
}
MASS_FOODS = frozenset(("bread", "honey", "soup", "cheese", "cake", "pie"))

DIALOGUE_HELLO = ("Hello", "Hi there", "Good morning", "Oh, hello", "Who are you", "Excuse me")
ASK_VERBS = ("asked", "called", "whispered", "wondered")
SAY_VERBS = ("said", "replied", "answered", "whispered", "called", "laughed")


def _fill(story: Story, text: str, p: str, p2: str) -> str:
    return text.replace("{p}", p).replace("{p2}", p2)


def _hero(story: Story, setting: str) -> tuple[str, str]:
    """(concept name, noun) of a creature or person of `setting` (mostly natives)."""
    rng = story.rng
    natives = BY_NAME[setting].natives
    pool = natives if natives and rng.random() < 0.8 else tuple(c.name for c in ANIMALS + CHARACTERS)
    name = rng.choice(pool)
    return name, story.word(name)


def generate_story(seed: int, index: int, grammar: int = 1) -> Story:
    """Story `index` of `seed` (same inputs, same story). grammar 2 varies the narration (LEADS,
    TAILS); grammar 1 is the one the bundled steerling-small was trained and evaluated on."""
    if grammar not in GRAMMARS:
        raise ValueError(f"grammar must be one of {GRAMMARS}, got {grammar}")
    rng = random.Random(seed * 1_000_003 + index)
    s = Story(rng, grammar=grammar)
    setting = rng.choice(SETTINGS).name
    hero_c, hero = _hero(s, setting)
    name = rng.choice(NAMES)
    he, his, him = ("he", "his", "him") if rng.random() < 0.5 else ("she", "her", "her")
    place = s.pick(setting, BY_NAME[setting].words[:2])  # the first two words name a place

    # opening
    adj = rng.choice(ADJ_LOOK)
    s.say(rng.choice((
        f"once upon a time, there was {article(adj)} {hero} named {name} who lived near the {place}.",
        f"{name} was {article(adj)} {hero} who lived by the {place}.",
        f"long ago, {article(adj)} {hero} called {name} made a home close to the {place}.",
        f"there once lived {article(adj)} {hero}. {his.capitalize()} name was {name}, and {he} lived near the {place}.",
        f"in a land far away, near {article(place)}, lived {article(hero)} named {name}.",
        f"this is the story of {name}, {article(adj)} {hero} from the {place}.",
    )))
    # the setting
    for _ in range(rng.randint(1, 2)):
        a = s.word(setting)
        b = pluralize(s.pick(setting, tuple(w for w in BY_NAME[setting].words if w != a)))
        s.say(rng.choice((
            f"every day, {name} looked at the {a} and the {b}.",
            f"the {a} was quiet, and the {b} were all around.",
            f"{he} knew all the {b} and visited the {a} often.",
            f"there were many {b} near the {a}.",
            f"beyond the {a}, the {b} went on and on.",
        )))
    # weather
    if rng.random() < 0.7:
        w = rng.choice(WEATHER).name
        s.concepts.add(w)
        s.say(rng.choice(TIMES) + ", " + rng.choice(WEATHER_LINES[w]) + ".")
    # the event: an object
    obj = s.word(rng.choice(OBJECTS).name)
    thing_adj = rng.choice(ADJ_THING)
    s.say(rng.choice(CONNECT) + ", " + rng.choice((
        f"{name} found {article(thing_adj)} {obj} near the {s.word(setting)}.",
        f"{name} saw {article(thing_adj)} {obj} lying on the ground.",
        f"something {thing_adj} caught {his} eye: it was {article(obj)}.",
        f"{he} came across {article(thing_adj)} {obj} that nobody had seen before.",
        f"{article(thing_adj)} {obj} appeared right in front of {him}.",
    )))
    emo = rng.choice(EMOTIONS).name
    if emo in EMOTION_NOUN and rng.random() < 0.5:
        x = s.pick(emo, EMOTION_NOUN[emo])
        s.say(rng.choice((f"{name} was filled with {x}.", f"{his} heart was full of {x}.")))
    else:
        x = s.pick(emo, EMOTION_ADJ[emo])
        s.say(rng.choice((f"{name} felt {x}.", f"{he} was very {x}.", f"it made {him} feel {x}.",
                          f"{name} was {x} and did not know what to do.")))
    # a second character and dialogue
    friend_c, friend = _hero(s, setting)
    fname = rng.choice([n for n in NAMES if n != name][:60]) if rng.random() < 0.5 else None
    who = f"{article(friend)} named {fname}" if fname else f"{article(friend)}"
    call = fname or f"the {friend}"
    s.say(rng.choice(CONNECT) + f", {who} came by.")
    if rng.random() < 0.75:
        s.concepts.add("dialogue")
        hello = rng.choice(DIALOGUE_HELLO)
        if s.grammar >= 2:   # the speakers address each other, and the question varies
            question = rng.choice(QUESTIONS).format(obj=obj, adj=thing_adj, article_obj=article(obj))
            s.say(f'"{hello}, {name}," {rng.choice(ASK_VERBS)} {call} {rng.choice(SPEECH_MANNERS)}. "{question}"')
        else:
            s.say(f'"{hello}," {rng.choice(ASK_VERBS)} {call}. "What is that {obj}?"')
        s.say(addressed(s, rng.choice((
            f'"I found it near the {s.word(setting)}," {rng.choice(SAY_VERBS)} {name}.',
            f'"I do not know yet," {rng.choice(SAY_VERBS)} {name}. "Shall we find out together?"',
            f'"It is mine now," {rng.choice(SAY_VERBS)} {name}, holding it close.',
            f'"Come and see," {rng.choice(SAY_VERBS)} {name}.',
        )), fname or f"little {friend}"))
    # actions
    actions = [a for a in BY_NAME[setting].actions]
    rng.shuffle(actions)
    for k, act in enumerate(actions[: rng.randint(1, 3)]):
        phrase = _fill(s, rng.choice(ACTION_PHRASES[act]), he, his)
        s.concepts.add(act)
        subject = rng.choice((f"{name} and {call}", "they", "the two of them")) if k else name
        s.say((rng.choice(CONNECT) + ", " if k else "") + f"{subject} {phrase}.")
    # food, sometimes
    if rng.random() < 0.4:
        food = s.word(rng.choice(FOODS).name)
        some = food if food in MASS_FOODS else pluralize(food)
        s.say(rng.choice((f"they stopped to eat some {some}.", f"{call} had brought some {some} for the way.",
                          f"by the {s.word(setting)}, they ate some {some}.",
                          f"{name} was hungry, so they had some {some}.")))
    # a second episode, sometimes
    if rng.random() < 0.6:
        _episode(s, setting, name, he, his, call)
    # problem and ending
    emo2 = rng.choice(EMOTIONS).name
    x = s.pick(emo2, EMOTION_ADJ[emo2])
    s.say(rng.choice((
        f"but then the {obj} was gone, and {name} was {x}.",
        f"but the way home was long, and {call} grew {x}.",
        f"at first, {name} was {x}, but {he} did not give up.",
        f"when the sun went down, {name} felt {x}.",
    )))
    moral = rng.choice(MORALS).name
    adjs, nouns, verbs = MORAL_FORMS[moral]
    forms = [(MORAL_ADJ_LINES, adjs), (MORAL_NOUN_LINES, nouns), (MORAL_VERB_LINES, verbs)]
    lines, words = rng.choice([f for f in forms if f[1]])
    line = rng.choice(lines).replace("{x}", s.pick(moral, words))
    s.say(rng.choice((
        f"in the end, everything turned out well, and {name} learned that {line}.",
        f"from that day on, {name} remembered that {line}.",
        f"and so {name} went home, knowing that {line}.",
        f"the moral of the story is that {line}." if s.grammar == 1 else f"the moral of {name}'s story is that {line}.",
    )), vary=False)
    s.prompt = _prompt(s, setting, hero_c, rng)
    return s


def _episode(s: Story, setting: str, name: str, he: str, his: str, call: str) -> None:
    rng = s.rng
    kind = rng.random()
    if kind < 0.35:
        w = rng.choice(WEATHER).name
        s.concepts.add(w)
        s.say(rng.choice(CONNECT) + ", " + rng.choice(WEATHER_LINES[w]) + ", " +
              rng.choice(("so they looked for shelter", "but they did not mind", "and everything changed",
                          "and they hurried on")) + ".")
    elif kind < 0.7:
        other_c, other = _hero(s, setting)
        s.say(rng.choice(CONNECT) + f", they met {article(rng.choice(ADJ_LOOK))} {other} " +
              rng.choice(("who needed help", "who was lost", "who had a question", "who wanted to come along")) + ".")
        if rng.random() < 0.6:
            s.concepts.add("dialogue")
            s.say(f'"Can you help me find the way to the {s.word(setting)}?" {rng.choice(ASK_VERBS)} the {other}.')
            s.say(addressed(s, f'"Of course," {rng.choice(SAY_VERBS)} {name}.', f"little {other}"))
    else:
        obj2 = s.word(rng.choice(OBJECTS).name)
        s.say(rng.choice(CONNECT) + f", {call} showed {name} {article(rng.choice(ADJ_THING))} {obj2}" +
              rng.choice((" from long ago", " that had a secret", " that nobody wanted", "")) + ".")
    act = rng.choice(BY_NAME[setting].actions)
    s.concepts.add(act)
    s.say(f"together they {_fill(s, rng.choice(ACTION_PHRASES[act]), 'they', 'their')}.")


def _prompt(s: Story, setting: str, hero: str, rng: random.Random) -> str:
    """An instruction this story answers (chat pairs)."""
    return rng.choice((
        f"Tell me a story about the {setting}.", f"Write a short story set in the {setting}.",
        f"Can you tell me a story about {article(hero)}?", f"Tell me a story about {article(hero)} and the {setting}.",
        f"Please write a children's story about {article(hero)}.", f"I would like a bedtime story about the {setting}.",
        f"Write a story with {article(hero)} in it.", "Tell me a story.", "Write a short story for a child.",
    ))
