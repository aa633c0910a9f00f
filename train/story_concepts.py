"""The story generator's concepts: each one a name, a group, a description and the words that
express it (base forms; the labeler finds their inflections through WordNet's exception lists
and suffix rules).

Rules that keep a story's tags exact (tests/test_train_data.py checks them):
* the word lists of different story concepts are disjoint;
* the generator writes a concept's words only through that concept (`stories.Story.word`), and
  its fixed template text uses none of them.
Stdlib only: this module runs on the GPU machine.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StoryConcept:
    name: str
    group: str
    description: str
    words: tuple[str, ...]
    # settings only: the animals / characters that live there, the actions that fit
    natives: tuple[str, ...] = field(default=())
    actions: tuple[str, ...] = field(default=())


def _c(group: str, name: str, words: str, description: str = "", natives: str = "", actions: str = "") -> StoryConcept:
    return StoryConcept(name, group, description or f"{group}: {name}", tuple(words.split(",")),
                        tuple(natives.split(",")) if natives else (), tuple(actions.split(",")) if actions else ())


SETTINGS = [
    _c("setting", "sea", "sea,ocean,wave,shore,beach,tide,coral,harbor", "the sea: waves, shore, beach, tides",
       "whale,dolphin,crab,octopus,turtle,seagull,sailor,fisherman,pirate", "swimming,sailing,exploring,digging,singing"),
    _c("setting", "forest", "forest,tree,oak,pine,moss,fern,woodland,branch", "a forest: trees, moss, ferns",
       "fox,owl,bear,deer,squirrel,wolf,hedgehog,rabbit,wizard", "climbing,exploring,hiding,running,building"),
    _c("setting", "city", "city,street,alley,traffic,sidewalk,skyscraper,subway,downtown",
       "a city: streets, alleys, traffic", "cat,dog,mouse,robot,doctor,baker,pigeon", "running,exploring,painting,dancing,reading"),
    _c("setting", "space", "planet,star,galaxy,comet,moon,orbit,spaceship,asteroid", "outer space: planets, stars, comets",
       "robot,astronaut,dragon", "flying,exploring,building,reading"),
    _c("setting", "farm", "farm,barn,tractor,hay,harvest,orchard,pasture,crop", "a farm: barns, fields, harvest",
       "cow,pig,sheep,horse,duck,chicken,goat,farmer,dog", "digging,building,cooking,running,singing"),
    _c("setting", "desert", "desert,dune,cactus,oasis,sand,canyon", "a desert: dunes, cactus, sand",
       "camel,lizard,snake,scorpion,wizard", "exploring,digging,hiding,climbing"),
    _c("setting", "mountain", "mountain,peak,cliff,summit,valley,slope,boulder", "mountains: peaks, cliffs, valleys",
       "goat,eagle,bear,wolf,knight", "climbing,exploring,hiding,singing"),
    _c("setting", "river", "river,stream,riverbank,waterfall,pebble,reed", "a river: streams, banks, waterfalls",
       "frog,duck,turtle,beaver,otter,fisherman", "swimming,sailing,jumping,building"),
    _c("setting", "village", "village,cottage,chimney,lane,bakery,villager", "a village: cottages, lanes, a bakery",
       "cat,dog,mouse,baker,grandmother,grandfather,girl,boy", "cooking,dancing,singing,reading,painting"),
    _c("setting", "castle", "castle,tower,moat,throne,drawbridge,dungeon,courtyard", "a castle: towers, moat, throne",
       "king,queen,princess,prince,knight,dragon,mouse", "dancing,hiding,climbing,reading"),
    _c("setting", "jungle", "jungle,rainforest,vine,canopy,swamp,bamboo", "a jungle: vines, canopy, rainforest",
       "monkey,tiger,parrot,elephant,snake,frog", "climbing,swimming,hiding,exploring"),
    _c("setting", "arctic", "arctic,iceberg,igloo,glacier,tundra,icicle", "the arctic: icebergs, igloos, glaciers",
       "penguin,walrus,wolf,puffin", "sliding,swimming,building,exploring"),
    _c("setting", "garden", "garden,pond,flower,daisy,tulip,hedge", "a garden: flowers, daisies, a pond",
       "bee,butterfly,snail,rabbit,frog,grandmother,girl", "digging,painting,singing,jumping"),
    _c("setting", "cave", "cave,tunnel,stalactite,cavern,crystal", "a cave: tunnels, crystals, caverns",
       "bat,bear,dragon,wizard", "exploring,hiding,climbing,digging"),
    _c("setting", "island", "island,lagoon,volcano,palm,hut", "an island: lagoons, palms, a volcano",
       "parrot,turtle,crab,monkey,pirate,sailor", "swimming,exploring,digging,building,sailing"),
    _c("setting", "school", "school,classroom,desk,chalkboard,playground,lesson", "a school: classrooms, desks, lessons",
       "teacher,girl,boy,robot,mouse", "reading,painting,singing,running,dancing"),
]

ANIMALS = [_c("animal", n, w, f"animal: {n}") for n, w in [
    ("fox", "fox"), ("rabbit", "rabbit,bunny"), ("owl", "owl"), ("bear", "bear,cub"), ("whale", "whale"),
    ("dolphin", "dolphin"), ("cat", "cat,kitten"), ("dog", "dog,puppy"), ("horse", "horse,pony"),
    ("cow", "cow,calf"), ("pig", "pig,piglet"), ("sheep", "sheep,lamb"), ("duck", "duck,duckling"),
    ("frog", "frog,tadpole"), ("turtle", "turtle,tortoise"), ("mouse", "mouse"), ("squirrel", "squirrel"),
    ("deer", "deer,fawn"), ("wolf", "wolf"), ("lion", "lion"), ("elephant", "elephant"), ("monkey", "monkey"),
    ("penguin", "penguin"), ("crab", "crab"), ("octopus", "octopus"), ("parrot", "parrot"), ("bee", "bee"),
    ("butterfly", "butterfly,caterpillar"), ("snail", "snail"), ("hedgehog", "hedgehog"), ("tiger", "tiger"),
    ("goat", "goat"), ("chicken", "chicken,hen,chick"), ("eagle", "eagle"), ("camel", "camel"),
    ("lizard", "lizard"), ("snake", "snake"), ("scorpion", "scorpion"), ("beaver", "beaver"), ("otter", "otter"),
    ("bat", "bat"), ("walrus", "walrus"), ("puffin", "puffin"), ("seagull", "seagull,gull"),
    ("pigeon", "pigeon"),
]]

CHARACTERS = [_c("character", n, w, f"character: {n}") for n, w in [
    ("girl", "girl"), ("boy", "boy"), ("king", "king"), ("queen", "queen"), ("princess", "princess"),
    ("prince", "prince"), ("knight", "knight"), ("farmer", "farmer"), ("sailor", "sailor"), ("wizard", "wizard"),
    ("robot", "robot"), ("astronaut", "astronaut"), ("fisherman", "fisherman"), ("baker", "baker"),
    ("grandmother", "grandmother,grandma,granny"), ("grandfather", "grandfather,grandpa"), ("teacher", "teacher"),
    ("pirate", "pirate"), ("doctor", "doctor"), ("dragon", "dragon"),
]]

WEATHER = [_c("weather", n, w, f"weather: {n}") for n, w in [
    ("rain", "rain,raindrop,drizzle,puddle"), ("snow", "snow,snowflake,blizzard,snowman"),
    ("wind", "wind,breeze,gust"), ("storm", "storm,thunder,lightning"), ("sunshine", "sunshine,sunny,sunbeam"),
    ("fog", "fog,mist,foggy"), ("rainbow", "rainbow"), ("cloud", "cloud,cloudy"),
]]

OBJECTS = [_c("object", n, n, f"object: {n}") for n in
           "lantern,key,map,ball,kite,boat,book,hat,basket,umbrella,treasure,seashell,crown,drum,flute,blanket,"
           "balloon,bicycle,candle,mirror,ring,clock,compass,bell,shovel,telescope,feather,rope,ladder,wagon".split(",")]

FOODS = [_c("food", n, w, f"food: {n}") for n, w in [
    ("apple", "apple"), ("cake", "cake,cupcake"), ("bread", "bread,loaf"), ("honey", "honey"), ("soup", "soup"),
    ("cookie", "cookie"), ("carrot", "carrot"), ("cheese", "cheese"), ("berry", "berry,strawberry,blueberry"),
    ("pie", "pie"),
]]

EMOTIONS = [_c("emotion", n, w, f"emotion: {n}") for n, w in [
    ("joy", "happy,glad,joyful,cheerful,delighted"), ("sadness", "sad,unhappy,gloomy,tearful,sorrowful"),
    ("fear", "afraid,scared,frightened,fearful,terrified"), ("anger", "angry,furious,grumpy,annoyed"),
    ("surprise", "surprised,amazed,astonished"), ("love", "love,adore,loving,affection"), ("pride", "proud,pride"),
    ("loneliness", "lonely,loneliness,alone"), ("hope", "hopeful,hope"), ("worry", "worried,nervous,anxious"),
    ("calm", "calm,peaceful,relaxed"), ("excitement", "excited,thrilled,eager"), ("shyness", "shy,timid,bashful"),
]]

ACTIONS = [_c("action", n, w, f"action: {n}") for n, w in [
    ("swimming", "swim,splash,paddle"), ("climbing", "climb,scramble"), ("running", "run,race,dash"),
    ("flying", "fly,soar,flutter"), ("digging", "dig,burrow"), ("singing", "sing,hum,song"),
    ("dancing", "dance,twirl"), ("building", "build,construct"), ("cooking", "cook,bake,stir"),
    ("reading", "read,storybook"), ("painting", "paint,paintbrush"), ("sailing", "sail,oar,sailboat"),
    ("exploring", "explore,wander,roam"), ("hiding", "hide,peek"), ("jumping", "jump,hop,leap"),
    ("sliding", "slide,glide"),
]]

MORALS = [_c("moral", n, w, f"moral: {n}") for n, w in [
    ("kindness", "kind,kindness"), ("honesty", "honest,honesty,truth"), ("sharing", "share,sharing"),
    ("courage", "brave,courage,bravery"), ("patience", "patient,patience"), ("friendship", "friendship"),
    ("perseverance", "perseverance,persistence"), ("gratitude", "grateful,thankful,gratitude"),
    ("forgiveness", "forgive,forgiveness"), ("teamwork", "teamwork,cooperate"),
    ("curiosity", "curious,curiosity"), ("humility", "humble,humility"), ("generosity", "generous,generosity"),
]]

# Tagged by the labeler on quoted speech, not by words.
DIALOGUE = StoryConcept("dialogue", "dialogue", "quoted speech between characters", ())

ALL_STORY_CONCEPTS: list[StoryConcept] = (
    SETTINGS + ANIMALS + CHARACTERS + WEATHER + OBJECTS + FOODS + EMOTIONS + ACTIONS + MORALS + [DIALOGUE])
BY_NAME: dict[str, StoryConcept] = {c.name: c for c in ALL_STORY_CONCEPTS}
STORY_GROUPS = ("setting", "animal", "character", "weather", "object", "food", "emotion", "action", "moral", "dialogue")

# Irregular forms the generator writes, mapped to the base form the lexicon holds. WordNet's
# exception lists cover these too; listing them here keeps story tags exact without WordNet.
IRREGULAR: dict[str, str] = {
    "swam": "swim", "swum": "swim", "swimming": "swim", "ran": "run", "running": "run", "flew": "fly",
    "flown": "fly", "dug": "dig", "digging": "dig", "sang": "sing", "sung": "sing", "hummed": "hum",
    "humming": "hum", "built": "build", "stirred": "stir", "stirring": "stir", "hid": "hide", "hidden": "hide",
    "hopped": "hop", "hopping": "hop", "leapt": "leap", "slid": "slide", "sliding": "slide",
    "mice": "mouse", "wolves": "wolf", "sheep": "sheep", "deer": "deer", "geese": "goose", "calves": "calf",
    "loaves": "loaf", "fishermen": "fisherman", "cacti": "cactus", "grandmas": "grandma",
}
