// Drive the chat page of a running `nextn serve` in headless Chromium: load it, send a prompt,
// wait for the streamed answer and its statistics, and save a screenshot.
//
//   node tools/browser/chat_page_check.mjs URL SCREENSHOT.png [PROMPT [IMAGE]]
//
// With IMAGE, the picture is attached through the page's attach button first.
// Prints one JSON object (the answer text, the statistics line, the bubbles shown, whether the
// answer's place showed how much of the prompt had been read) and exits 1 with the reason when
// the page does not show an answer with its statistics.
import { chromium } from "playwright-core";

const [url, screenshot, prompt = "Write a Python function that reverses a string.", image] = process.argv.slice(2);
if (!url || !screenshot) {
  console.error("usage: chat_page_check.mjs URL SCREENSHOT.png [PROMPT]");
  process.exit(2);
}
const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"],
});
let failed = null;
try {
  const page = await browser.newPage({ viewport: { width: 1000, height: 700 } });
  const errors = [];
  page.on("pageerror", (e) => errors.push(String(e)));
  await page.goto(url);
  await page.waitForFunction(() => document.getElementById("model").textContent.length > 0, null, { timeout: 30000 });
  // Every text the answer's place shows on the way, such as the prompt's progress.
  await page.evaluate(() => {
    window.shownTexts = [];
    new MutationObserver(() => {
      for (const e of document.querySelectorAll(".msg.assistant .content")) window.shownTexts.push(e.textContent);
    }).observe(document.getElementById("messages"), { subtree: true, childList: true, characterData: true });
  });
  if (image) {
    await page.waitForSelector("#attach:not([hidden])", { timeout: 30000 });
    await page.setInputFiles("#file", image);
    await page.waitForSelector("#attached img", { timeout: 30000 });
  }
  await page.fill("#prompt", prompt);
  await page.click("#send");
  await page.waitForSelector(".msg.assistant .stats", { timeout: 120000 });
  const result = await page.evaluate(() => ({
    model: document.getElementById("model").textContent,
    user: [...document.querySelectorAll(".msg.user .content")].map((e) => e.textContent),
    user_images: document.querySelectorAll(".msg.user img").length,
    attach_offered: !document.getElementById("attach").hidden,
    answer: document.querySelector(".msg.assistant .content").textContent,
    stats: document.querySelector(".msg.assistant .stats").textContent,
    error: !!document.querySelector(".msg.error"),
    prompt_progress_shown: window.shownTexts.some((t) => t.startsWith("reading the prompt")),
  }));
  await page.screenshot({ path: screenshot });
  result.page_errors = errors;
  console.log(JSON.stringify(result));
  if (result.error || errors.length) failed = "the page shows an error";
  else if (!result.answer.trim()) failed = "no answer text";
  else if (!/tok\/s/.test(result.stats)) failed = "no speed in the statistics";
} finally {
  await browser.close();
}
if (failed) {
  console.error(failed);
  process.exit(1);
}
