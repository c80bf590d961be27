// A small orchestration: parallel tool calls, a namespaced tool, store/load across cells,
// a notification and an image. Run: codemode run examples/orchestrate.js --tools examples/tools.py
const cities = ["Paris", "Lisbon", "Oslo"];
notify(`fetching weather for ${cities.length} cities`);
const reports = await Promise.all(cities.map((city) => tools.weather({ city })));
for (const r of reports) text(`${r.city}: ${r.celsius}°C, ${r.sky}`);

const average = await tools.math__mean({ values: reports.map((r) => r.celsius) });
text(`average: ${average.toFixed(1)}°C`);

const previous = load("last_average");
store("last_average", average);
text(previous === undefined ? "first run in this session" : `previous average: ${previous}`);

try {
  await tools.weather({ city: "Atlantis" });
} catch (error) {
  text(`expected failure: ${error}`);
}

image(await tools.bar_chart({ values: reports.map((r) => r.celsius) }));
