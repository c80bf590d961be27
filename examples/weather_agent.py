"""The tools and cells the example agent loops share (one scripted conversation, three model APIs).

``add_tools`` registers the agent's tools; ``FIRST_CELL`` and ``SLOW_CELL`` are the JavaScript the
scripted model writes: one cell that completes, one that yields before its slow tool answers.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any, Final

from codemode import ToolRegistry

_WEATHER = {"paris": (18, "cloudy"), "lisbon": (24, "sunny"), "oslo": (9, "rain")}


async def weather(city: str) -> dict[str, Any]:
    """Current weather of a city: `{ city, celsius, sky }`."""
    await asyncio.sleep(0.05)  # stands in for a remote API
    key = city.lower()
    if key not in _WEATHER:
        raise ValueError(f"unknown city {city!r}")
    celsius, sky = _WEATHER[key]
    return {"city": city, "celsius": celsius, "sky": sky}


async def forecast(city: str, days: int = 3) -> list[str]:
    """A slow multi-day forecast: one sky description per day."""
    await asyncio.sleep(1.0)  # long enough for the cell to yield to the model first
    _, sky = _WEATHER.get(city.lower(), (0, "unknown"))
    return [sky if day % 2 == 0 else "clear" for day in range(days)]


def mean(values: list[float]) -> float:
    """Arithmetic mean of a non-empty list of numbers."""
    return sum(values) / len(values)


FIRST_CELL = """\
const cities = ["Paris", "Lisbon", "Oslo"];
notify(`looking up ${cities.length} cities`);
const reports = await Promise.all(cities.map((city) => tools.weather({ city })));
for (const r of reports) text(`${r.city}: ${r.celsius}°C, ${r.sky}`);
const average = await tools.stats__mean({ values: reports.map((r) => r.celsius) });
store("average", average);
text(`average: ${average.toFixed(1)}°C`);
try {
  await tools.weather({ city: "Atlantis" });
} catch (error) {
  text(`expected failure: ${error}`);
}"""

# The pragma asks for the first answer after 200 ms; the forecast takes a second.
SLOW_CELL = """\
// @exec: {"yield_time_ms": 200}
text("forecast requested");
const days = await tools.forecast({ city: "Oslo", days: 3 });
text(`Oslo: ${days.join(", ")}; today's average was ${load("average").toFixed(1)}°C`);"""


#: What an output that yielded says first, with the cell id to wait on.
RUNNING: Final = re.compile(r"^Script running with cell ID (\S+)$", re.MULTILINE)


def add_tools(registry: ToolRegistry) -> None:
    """Register the example tools: `weather`, the slow `forecast` and `stats.mean`."""
    registry.describe_namespace("stats", "Small statistics helpers.")
    registry.tool(weather)
    registry.tool(forecast)
    registry.tool(namespace="stats")(mean)
