// The page's keyboard, phone and continuity touches: plain listeners on the document (they survive Gradio's
// re-renders), no framework.
(() => {
  const $ = (selector) => document.querySelector(selector);
  const narrow = () => window.matchMedia("(max-width: 768px)").matches;

  // Ctrl/Cmd+Enter in the description or lyrics box generates.
  document.addEventListener("keydown", (event) => {
    if (event.key !== "Enter" || !(event.ctrlKey || event.metaKey)) return;
    if (!(event.target instanceof Element) || !event.target.closest("#description, #lyrics")) return;
    const button = $("#generate");
    if (!button || button.disabled) return;
    event.preventDefault();
    button.click();
  }, true);

  // A short note at the top of the screen (fixed, so it is seen wherever the page is scrolled).
  const toast = (text) => {
    let box = $("#m3-toast");
    if (!box) {
      box = document.createElement("div");
      box.id = "m3-toast";
      box.setAttribute("role", "status");
      document.body.appendChild(box);
    }
    box.textContent = text;
    box.classList.add("m3-show");
    clearTimeout(box.hideTimer);
    box.hideTimer = setTimeout(() => box.classList.remove("m3-show"), 3500);
  };

  document.addEventListener("click", (event) => {
    if (!(event.target instanceof Element)) return;
    // An example or "reuse these settings" fills the form: bring the form into view and say what happened.
    const filler = event.target.closest("#examples button, .m3-reuse");
    if (filler) {
      const text = filler.closest(".m3-reuse")
        ? "✓ Settings and seed of that song filled in: press Generate to make it again."
        : `✓ Filled in from the example “${filler.innerText.trim()}”: press Generate.`;
      // Instant, and once more after the form has re-rendered with its new text (a smooth scroll gets cut short by
      // that re-layout).
      const toForm = () => $("#form")?.scrollIntoView({ block: "start" });
      setTimeout(() => {
        const form = $("#form");
        if (!form) return;
        toForm();
        form.classList.add("m3-flash");
        setTimeout(() => form.classList.remove("m3-flash"), 1600);
        toast(text);
      }, 150);
      setTimeout(toForm, 600);
      return;
    }
    if (event.target.closest("#generate")) {
      livePosition = null;
      if (narrow()) {  // on a phone the song's progress is far below the form: follow it
        setTimeout(() => {
          if (!$("#refusal .m3-refusal")) $("#run-status")?.scrollIntoView({ behavior: "smooth", block: "start" });
        }, 400);
      }
    }
    if (event.target.closest(".m3-play") && narrow()) {
      setTimeout(() => $("#result")?.scrollIntoView({ behavior: "smooth", block: "center" }), 300);
    }
  }, true);

  // Sliders clamp a typed number when its box loses focus: say so, in validate()'s words (window.M3_FIELDS names
  // each field as validate() does).
  const fmt = (value) => (Number.isInteger(value) ? String(value) : String(+value.toPrecision(6)));
  document.addEventListener("input", (event) => {
    const box = event.target;
    if (box instanceof HTMLInputElement && box.type === "number") box.dataset.typed = box.value;
  }, true);
  const noteClamp = (event) => {
    const box = event.target;
    if (!(box instanceof HTMLInputElement) || box.type !== "number" || box.dataset.typed === undefined) return;
    const field = box.closest("[id]");
    const name = field && (window.M3_FIELDS || {})[field.id];
    const typed = parseFloat(box.dataset.typed);
    if (!name || !Number.isFinite(typed)) return;
    setTimeout(() => {
      const now = parseFloat(box.value);
      let note = field.nextElementSibling;
      if (!note || !note.classList.contains("m3-field-note")) note = null;
      if (now !== typed && box.min !== "" && box.max !== "") {
        delete box.dataset.typed;
        if (!note) {
          note = document.createElement("div");
          note.className = "m3-field-note";
          note.setAttribute("role", "alert");
          field.insertAdjacentElement("afterend", note);
        }
        note.textContent = `${name} must be between ${fmt(+box.min)} and ${fmt(+box.max)}, got ${fmt(typed)}: ` +
          `it is set to ${fmt(now)}.`;
      } else if (note) {
        note.remove();
      }
    }, 60);
  };
  document.addEventListener("blur", noteClamp, true);
  document.addEventListener("change", noteClamp, true);

  // One player: when the finished song replaces the live stream, it goes on from where the listener was.
  let livePosition = null;
  document.addEventListener("timeupdate", (event) => {
    const audio = event.target;
    if (audio instanceof HTMLMediaElement && audio.closest("#live-audio")) {
      livePosition = { time: audio.currentTime, playing: !audio.paused };
    }
  }, true);
  document.addEventListener("loadedmetadata", (event) => {
    const audio = event.target;
    if (!(audio instanceof HTMLMediaElement) || !audio.closest("#result-audio")) return;
    document.querySelectorAll("#live-audio audio").forEach((live) => live.pause());
    const position = livePosition;
    livePosition = null;
    if (position && position.playing && position.time < audio.duration - 0.25) {
      audio.currentTime = position.time;
      audio.play().catch(() => {});
    }
  }, true);
})();
