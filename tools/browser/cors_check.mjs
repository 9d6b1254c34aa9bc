// Call a running `nextn serve` from pages on other origins in headless Chromium, as a browser
// front-end does: fetch() with an API key, so that the browser sends a CORS preflight and reads
// the answer only if the server allows the page's origin and every header it sends.
//
//   node tools/browser/cors_check.mjs API_URL KEY PAGE_URL...
//
// For each page (any HTML page on its origin), four calls from inside the page:
//   models:           GET  API_URL/v1/models with `Authorization: Bearer KEY`
//   chat:             POST API_URL/v1/chat/completions with `Authorization`, a JSON body and the
//                     headers the official openai JavaScript client adds (x-stainless-*)
//   with_credentials: GET  API_URL/v1/models with `Authorization` and `credentials: "include"`
//   messages:         POST API_URL/v1/messages with `x-api-key`, `anthropic-version` and
//                     `anthropic-dangerous-direct-browser-access`, as the anthropic client sends
// Prints one JSON object {PAGE_URL: {CALL: RESULT, ...}}, where
// RESULT is {status, body} when the page could read the answer and {error} when the browser
// refused it (a TypeError: the CORS check failed). Exits 1 with the reason if the browser or a
// page cannot be driven, or after two minutes whatever happens.
import { chromium } from "playwright-core";

const [api, key, ...pages] = process.argv.slice(2);
if (!api || !key || pages.length === 0) {
  console.error("usage: cors_check.mjs API_URL KEY PAGE_URL...");
  process.exit(2);
}
setTimeout(() => {
  console.error("cors_check: timed out after 120 s");
  process.exit(1);
}, 120000).unref();

const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"],
});
const results = {};
try {
  for (const pageUrl of pages) {
    const page = await browser.newPage();
    await page.goto(pageUrl, { timeout: 30000 });
    results[pageUrl] = await page.evaluate(async ({ api, key }) => {
      async function call(path, init) {
        try {
          const r = await fetch(api + path, { ...init, signal: AbortSignal.timeout(60000) });
          return { status: r.status, body: await r.json() };
        } catch (e) {
          return { error: String(e) };
        }
      }
      const json = { "Content-Type": "application/json" };
      return {
        models: await call("/v1/models", { headers: { Authorization: "Bearer " + key } }),
        chat: await call("/v1/chat/completions", {
          method: "POST",
          headers: {
            ...json,
            Authorization: "Bearer " + key,
            "X-Stainless-Lang": "js",
            "X-Stainless-Package-Version": "4.0.0",
            "X-Stainless-OS": "Linux",
            "X-Stainless-Arch": "x64",
            "X-Stainless-Runtime": "browser:chrome",
            "X-Stainless-Runtime-Version": "156",
            "X-Stainless-Retry-Count": "0",
            "X-Stainless-Timeout": "600",
          },
          body: JSON.stringify({ messages: [{ role: "user", content: "hi" }], max_tokens: 2 }),
        }),
        // As a front-end that also sends cookies: the browser then takes no wildcard in the
        // answer, so the origin and every header must be named.
        with_credentials: await call("/v1/models", {
          credentials: "include",
          headers: { Authorization: "Bearer " + key, "X-Stainless-Retry-Count": "0" },
        }),
        messages: await call("/v1/messages", {
          method: "POST",
          headers: {
            ...json,
            "x-api-key": key,
            "anthropic-version": "2023-06-01",
            "anthropic-dangerous-direct-browser-access": "true",
          },
          body: JSON.stringify({
            model: "m", max_tokens: 2, messages: [{ role: "user", content: "hi" }],
          }),
        }),
      };
    }, { api, key });
    await page.close();
  }
} finally {
  await browser.close();
}
console.log(JSON.stringify(results));
