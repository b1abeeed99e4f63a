package outboxui_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
	"github.com/gorm-outbox/outbox/outboxui"
)

// chromium returns the browser to drive: $OUTBOX_CHROMIUM, or Debian's
// chromium on the PATH. Without one the test skips, and fails under CI=true.
func chromium(t *testing.T) string {
	t.Helper()
	path := os.Getenv("OUTBOX_CHROMIUM")
	if path == "" {
		var err error
		if path, err = exec.LookPath("chromium"); err != nil {
			if os.Getenv("CI") == "true" {
				t.Fatal("no chromium on the PATH (CI=true, so this fails instead of skipping): apt-get install -y chromium, or set OUTBOX_CHROMIUM")
			}
			t.Skip("skipping: no chromium on the PATH (apt-get install -y chromium, or set OUTBOX_CHROMIUM)")
		}
	}
	return path
}

// browser starts a headless Chromium with a fresh profile for the test and
// returns a tab of it; the browser ends with the test.
func browser(t *testing.T) context.Context {
	t.Helper()
	opts := append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(chromium(t)),
		chromedp.Flag("headless", true),
		chromedp.Flag("no-sandbox", true),
		chromedp.Flag("disable-gpu", true),
		chromedp.Flag("disable-quic", true),
		chromedp.Flag("no-first-run", true),
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.Flag("disable-dev-shm-usage", true),
		chromedp.UserDataDir(t.TempDir()),
		chromedp.WindowSize(1280, 900),
	)
	alloc, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	ctx, cancelTab := chromedp.NewContext(alloc)
	t.Cleanup(func() { cancelTab(); cancelAlloc() })
	// The first run starts the browser, for as long as ctx lives: no
	// timeout on it (steps get theirs from do).
	if err := chromedp.Do(ctx); err != nil {
		t.Fatalf("start chromium: %v", err)
	}
	return ctx
}

// do runs steps in the tab of ctx, within 20 seconds.
func do(t *testing.T, ctx context.Context, steps ...chromedp.Action[chromedp.Void]) {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	if err := chromedp.Do(ctx, steps...); err != nil {
		t.Fatal(err)
	}
}

// eval returns the value of a script in the tab of ctx.
func eval[T any](t *testing.T, ctx context.Context, expr string, opts ...chromedp.EvaluateOption) T {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	v, err := chromedp.Run(ctx, chromedp.Evaluate[T](expr, opts...))
	if err != nil {
		t.Fatalf("%s: %v", expr, err)
	}
	return v
}

// screenshot saves the whole page as name.png under the test's temp dir,
// and logs its path.
func screenshot(t *testing.T, ctx context.Context, name string) []byte {
	t.Helper()
	png, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
	if err != nil {
		t.Fatalf("screenshot %s: %v", name, err)
	}
	path := filepath.Join(t.TempDir(), name+".png")
	if err := os.WriteFile(path, png, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("screenshot of the %s page: %s", name, path)
	return png
}

// signIn opens the dashboard, which shows the login form, and signs in
// with the token.
func signIn(t *testing.T, ctx context.Context, s *site) {
	t.Helper()
	do(t, ctx,
		chromedp.Navigate(s.url("")),
		chromedp.WaitVisible(chromedp.ID("token")),
		chromedp.SendKeys(chromedp.ID("token"), token),
		chromedp.Click(chromedp.ID("sign-in")),
		chromedp.WaitVisible(chromedp.ID("panel")),
	)
}

func text(t *testing.T, ctx context.Context, sel string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	s, err := chromedp.Run(ctx, chromedp.Text(chromedp.CSS(sel)))
	if err != nil {
		t.Fatalf("text of %s: %v", sel, err)
	}
	return strings.TrimSpace(s)
}

// busy fills s with what a dashboard shows: pending events, deliveries and
// failures spread over the last hour, and dead letters.
func busy(t *testing.T, s *site) {
	t.Helper()
	for i := range 40 {
		s.publish(t, outbox.Event{Type: "order.created", AggregateType: "order", AggregateID: string(rune('A' + i%8)),
			Payload: map[string]int{"n": i}})
	}
	now := time.Now()
	for i := range 30 {
		s.exec(t, `UPDATE outbox_records SET delivery_state = 'delivered', delivered_at = ?, delivery_attempts = 1 WHERE id = ?`,
			s.ts(now.Add(-time.Duration(i*2)*time.Minute)), i+1)
	}
	s.exec(t, `UPDATE outbox_records SET delivery_state = 'retry', delivery_attempts = 2, last_error = 'broker timeout', updated_at = ? WHERE id IN (31, 32)`,
		s.ts(now.Add(-5*time.Minute)))
}

func TestDashboardInABrowser(t *testing.T) {
	t.Parallel()
	s := newSite(t, outboxtest.SQLite, outboxui.WithToken(token), outboxui.WithRefresh(time.Second))
	busy(t, s)
	s.publish(t,
		outbox.Event{ID: "dead-1", Type: "payment.captured", AggregateType: "payment", AggregateID: "p-1", Payload: map[string]int{"amount": 100}},
		outbox.Event{ID: "dead-2", Type: "payment.captured", AggregateType: "payment", AggregateID: "p-2"},
		outbox.Event{ID: "dead-3", Type: "payment.captured", AggregateType: "payment", AggregateID: "p-3"},
		outbox.Event{ID: "waits-1", Type: "payment.refunded", AggregateType: "payment", AggregateID: "p-1"},
		outbox.Event{ID: "markup", Type: "note.added", AggregateType: "note", AggregateID: "n-1",
			Payload: map[string]string{"body": "<script>document.title='pwned'</script><b>bold</b>"}},
	)
	s.fail(t, "dead-1", "dead-2", "dead-3")
	stats, err := s.d.Stats(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	ctx := browser(t)

	t.Run("a request without credentials gets 401", func(t *testing.T) {
		do(t, ctx, chromedp.Navigate(s.url("")), chromedp.WaitVisible(chromedp.ID("token")))
		status := eval[int](t, ctx, `fetch("dead").then(r => r.status)`, chromedp.EvalAwaitPromise)
		screenshot(t, ctx, "login")
		if status != 401 {
			t.Fatalf("fetch of the dead letters without a session: %d, want 401", status)
		}
	})

	signIn(t, ctx, s)

	t.Run("the overview shows the counts written", func(t *testing.T) {
		for state, want := range map[string]int64{
			outbox.StatePending: stats.Pending, outbox.StateDelivered: stats.Delivered,
			outbox.StateRetry: stats.Retry, outbox.StateFailed: stats.Failed,
		} {
			if got := text(t, ctx, "#count-"+state); got != strconv.FormatInt(want, 10) {
				t.Errorf("%s shows %s, want %d", state, got, want)
			}
		}
		if stats.Pending != 10 || stats.Delivered != 30 || stats.Failed != 3 {
			t.Fatalf("the fixture wrote %+v", stats)
		}
		bars := eval[int](t, ctx, `[...document.querySelectorAll("svg.chart rect.delivered")].filter(r => r.getAttribute("height") > 0).length`)
		if bars != 30 {
			t.Errorf("the chart has %d minutes with deliveries, want 30", bars)
		}
		png := screenshot(t, ctx, "overview")
		if path := os.Getenv("OUTBOXUI_SCREENSHOT"); path != "" {
			if err := os.WriteFile(path, png, 0o644); err != nil {
				t.Fatal(err)
			}
			t.Logf("overview screenshot also saved as %s", path)
		}
	})

	t.Run("the overview refreshes by itself", func(t *testing.T) {
		s.publish(t, outbox.Event{Type: "order.created", AggregateType: "order", AggregateID: "Z"})
		want := strconv.FormatInt(stats.Pending+1, 10)
		if _, err := chromedp.Run(ctx, chromedp.Poll[bool](`document.getElementById("count-pending").textContent === "`+want+`"`,
			chromedp.WithPollingTimeout(15*time.Second))); err != nil {
			t.Fatalf("the pending count did not become %s without a reload: %v", want, err)
		}
	})

	t.Run("a dead letter's requeue button moves it to pending", func(t *testing.T) {
		do(t, ctx, chromedp.Navigate(s.url("dead")), chromedp.WaitVisible(chromedp.ID("row-dead-1")))
		screenshot(t, ctx, "dead-letters")
		do(t, ctx, chromedp.Click(chromedp.CSS("#row-dead-1 button.requeue-one")), chromedp.WaitVisible(chromedp.ID("notice")))
		outboxtest.WaitUntil(t, func() bool { return s.state(t, "dead-1") == outbox.StatePending }, "dead-1 to be pending")
		if got := s.state(t, "dead-2"); got != outbox.StateFailed {
			t.Fatalf("dead-2 is %s after another row's button, want failed", got)
		}
		if n := text(t, ctx, "#notice"); !strings.Contains(n, "Requeued 1") {
			t.Fatalf("notice %q", n)
		}
	})

	t.Run("the selected dead letters are requeued together", func(t *testing.T) {
		do(t, ctx,
			chromedp.WaitVisible(chromedp.ID("row-dead-2")),
			chromedp.Click(chromedp.ID("select-all")),
			chromedp.Click(chromedp.ID("requeue-selected")),
		)
		outboxtest.WaitUntil(t, func() bool {
			return s.state(t, "dead-2") == outbox.StatePending && s.state(t, "dead-3") == outbox.StatePending
		}, "the selected dead letters to be pending")
		do(t, ctx, chromedp.WaitVisible(chromedp.CSS("td.none")))
	})

	t.Run("a payload with markup is shown as text", func(t *testing.T) {
		do(t, ctx, chromedp.Navigate(s.url("message?id=markup")), chromedp.WaitVisible(chromedp.ID("payload")))
		title := eval[string](t, ctx, `document.title`)
		scripts := eval[int](t, ctx, `document.querySelectorAll("script").length + document.querySelectorAll("main b").length`)
		screenshot(t, ctx, "message")
		if got := text(t, ctx, "#payload"); !strings.Contains(got, `<script>document.title='pwned'</script><b>bold</b>`) {
			t.Fatalf("payload shows %q, want the markup as text", got)
		}
		if strings.Contains(title, "pwned") || scripts != 1 {
			t.Fatalf("the payload's markup ran or rendered: title %q, %d script and b elements (want only the dashboard's script)", title, scripts)
		}
	})

	t.Run("a message says what holds it back", func(t *testing.T) {
		s.fail(t, "dead-1")
		do(t, ctx, chromedp.Navigate(s.url("message?id=waits-1")), chromedp.WaitVisible(chromedp.ID("held")))
		if held := text(t, ctx, "#held"); !strings.Contains(held, "sequence 1") || !strings.Contains(held, "dead letter") {
			t.Fatalf("held back says %q", held)
		}
		screenshot(t, ctx, "message-held-back")
	})

	t.Run("search finds an aggregate", func(t *testing.T) {
		do(t, ctx, chromedp.Navigate(s.url("search?q=payment/p-1")), chromedp.WaitVisible(chromedp.CSS("table.messages")))
		if got := text(t, ctx, "table.messages tbody"); !strings.Contains(got, "dead-1") || !strings.Contains(got, "waits-1") || strings.Contains(got, "dead-2") {
			t.Fatalf("search results %q", got)
		}
		screenshot(t, ctx, "search")
	})

	t.Run("a dead letter is discarded after its confirmation, releasing its aggregate", func(t *testing.T) {
		s.exec(t, `UPDATE outbox_records SET next_attempt_at = ? WHERE event_id = 'waits-1'`, s.ts(time.Now().Add(time.Hour)))
		do(t, ctx, chromedp.Navigate(s.url("dead")), chromedp.WaitVisible(chromedp.ID("row-dead-1")),
			chromedp.Click(chromedp.CSS("#row-dead-1 button.discard-one")), chromedp.WaitVisible(chromedp.ID("discard-confirm")))
		screenshot(t, ctx, "discard-confirmation")
		if got := s.state(t, "dead-1"); got != outbox.StateFailed {
			t.Fatalf("dead-1 is %q before the confirmation, want failed", got)
		}
		if w := text(t, ctx, "#discard-warning"); !strings.Contains(w, "never be delivered") {
			t.Fatalf("the confirmation says %q", w)
		}
		// Cancel leaves it; confirming discards it.
		do(t, ctx, chromedp.Click(chromedp.ID("discard-cancel")), chromedp.WaitVisible(chromedp.ID("row-dead-1")))
		if got := s.state(t, "dead-1"); got != outbox.StateFailed {
			t.Fatalf("dead-1 is %q after the cancel, want failed", got)
		}
		do(t, ctx, chromedp.Click(chromedp.CSS("#row-dead-1 button.discard-one")), chromedp.WaitVisible(chromedp.ID("discard-confirm")),
			chromedp.Click(chromedp.ID("discard-confirm")), chromedp.WaitVisible(chromedp.ID("notice")))
		if n := text(t, ctx, "#notice"); !strings.Contains(n, "Discarded 1") {
			t.Fatalf("notice %q", n)
		}
		outboxtest.WaitUntil(t, func() bool { return s.state(t, "dead-1") == "" }, "dead-1 to leave the outbox table")
		var due int64
		if err := s.db.Raw(`SELECT count(*) FROM outbox_records WHERE event_id = 'waits-1' AND next_attempt_at <= ?`, s.ts(time.Now())).Scan(&due).Error; err != nil {
			t.Fatal(err)
		}
		if due != 1 {
			t.Fatal("waits-1, held back behind dead-1, is not due after the discard")
		}
	})
}
