"""A fixed English text for perplexity checks, written for this project and dedicated to the
public domain (CC0). Plain prose, so a small instruction-tuned model predicts it reasonably."""

TEXT = """\
The lighthouse stood at the end of a long stone pier, and every evening the keeper climbed the \
one hundred and twelve steps to light the lamp. He had done this for thirty years. In winter the \
wind came off the sea so hard that the glass hummed, and in summer the gulls sat on the railing \
and watched him with their yellow eyes. Ships passed far out on the water, and most of them never \
knew his name, but they knew the light, and that was enough for him.

One morning a girl from the village walked out along the pier with a basket of bread. She said \
that her mother had baked too much, and that it would be a shame to let it go stale. The keeper \
thanked her and asked whether she would like to see the lamp. She said yes, so they climbed the \
stairs together, counting each step out loud. At the top she pressed her hands against the \
window and looked at the grey water, which stretched all the way to the edge of the sky.

"How do you know when to light it?" she asked. He told her that he watched the sun. When the \
lowest part of it touched the horizon, he struck a match. When the first stars came out, he \
checked the wick. When the morning came, he let the flame go out and cleaned the glass, so that \
the light would be bright again the next night. It was simple work, he said, but it had to be \
done every single day, because the one night it was not done would be the night that mattered.

The girl came back often after that. She learned to trim the wick and to polish the brass, and \
she learned the names of the ships by the shapes of their sails. Years later, when the keeper \
grew too old for the stairs, she climbed them for him, and the light never once went dark.
"""
