package outboxui

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"html/template"
	"net/http"
	"net/url"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/outboxinspect"
)

var pageNames = []string{"overview", "dead", "discard", "message", "search", "login"}

func parsePages() map[string]*template.Template {
	funcs := template.FuncMap{
		"ago":   func(t time.Time) string { return ago(t, time.Now()) },
		"stamp": stamp,
	}
	pages := make(map[string]*template.Template, len(pageNames))
	for _, name := range pageNames {
		pages[name] = template.Must(template.New(name).Funcs(funcs).ParseFS(templateFS, "templates/layout.html", "templates/"+name+".html"))
	}
	return pages
}

// pageData is what every page's template gets.
type pageData struct {
	Title  string
	Table  string
	Nav    string
	Notice string
	Error  string
	Data   any
}

// render executes page's layout, or with partial its "panel" only.
func (u *ui) render(w http.ResponseWriter, r *http.Request, page string, p pageData) {
	if u.d != nil {
		p.Table = u.d.Table()
	}
	p.Nav = page
	name := "layout"
	if r.URL.Query().Get("partial") == "1" && page == "overview" {
		name = "panel"
	}
	var b bytes.Buffer
	if err := u.pages[page].ExecuteTemplate(&b, name, p); err != nil {
		http.Error(w, "outboxui: render "+page+": "+err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Write(b.Bytes())
}

// fail answers a failed read or write with its error, escaped.
func (u *ui) fail(w http.ResponseWriter, r *http.Request, status int, err error) {
	w.WriteHeader(status)
	u.render(w, r, "search", pageData{Title: "Error", Error: err.Error(), Data: searchData{}})
}

func ago(t, now time.Time) string {
	if t.IsZero() {
		return "-"
	}
	d := now.Sub(t)
	if d < 0 {
		return "in " + (-d).Round(time.Second).String()
	}
	if d < time.Minute {
		return d.Round(100*time.Millisecond).String() + " ago"
	}
	return d.Round(time.Second).String() + " ago"
}

func stamp(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return t.UTC().Format("2006-01-02 15:04:05.000 UTC")
}

// chartBar is one minute of the overview's chart, drawn as SVG.
type chartBar struct {
	X, DeliveredY, DeliveredH, FailedY, FailedH int
	Label                                       string
}

type overviewData struct {
	Stats     outbox.Stats
	States    []stateCount
	OldestDue string
	Bars      []chartBar
	Delivered int64
	Failed    int64
	MaxPerMin int64
	Refresh   int64 // milliseconds
}

type stateCount struct {
	State string
	Count int64
}

const (
	chartHeight = 120
	barWidth    = 10
)

func (u *ui) overview(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	s, err := u.d.Stats(ctx)
	if err != nil {
		u.fail(w, r, http.StatusInternalServerError, err)
		return
	}
	buckets, err := u.in.Activity(ctx, time.Minute, 60)
	if err != nil {
		u.fail(w, r, http.StatusInternalServerError, err)
		return
	}
	data := overviewData{Stats: s, Refresh: u.cfg.refresh.Milliseconds(), OldestDue: "nothing due"}
	if !s.OldestDue.IsZero() {
		data.OldestDue = time.Since(s.OldestDue).Round(100 * time.Millisecond).String()
	}
	data.States = []stateCount{{outbox.StatePending, s.Pending}, {outbox.StateDelivering, s.Delivering},
		{outbox.StateRetry, s.Retry}, {outbox.StateFailed, s.Failed}, {outbox.StateDelivered, s.Delivered}}
	for _, b := range buckets {
		data.MaxPerMin = max(data.MaxPerMin, b.Delivered+b.Failed)
		data.Delivered += b.Delivered
		data.Failed += b.Failed
	}
	scale := max(data.MaxPerMin, 1)
	for i, b := range buckets {
		dh := int(b.Delivered * chartHeight / scale)
		fh := int(b.Failed * chartHeight / scale)
		data.Bars = append(data.Bars, chartBar{
			X: i * barWidth, DeliveredY: chartHeight - dh, DeliveredH: dh, FailedY: chartHeight - dh - fh, FailedH: fh,
			Label: fmt.Sprintf("%s: %d delivered, %d failed", b.Start.UTC().Format("15:04"), b.Delivered, b.Failed),
		})
	}
	u.render(w, r, "overview", pageData{Title: "Overview", Data: data})
}

type deadData struct {
	Messages []outboxinspect.MessageInfo
	Limit    int
}

const deadLimit = 500

func (u *ui) dead(w http.ResponseWriter, r *http.Request) {
	msgs, err := u.in.Messages(r.Context(), outboxinspect.MessageFilter{States: []string{outbox.StateFailed}, Limit: deadLimit})
	if err != nil {
		u.fail(w, r, http.StatusInternalServerError, err)
		return
	}
	notice := ""
	if n := r.URL.Query().Get("requeued"); n != "" {
		notice = "Requeued " + n + " message(s): they are pending again."
	}
	if n := r.URL.Query().Get("discarded"); n != "" {
		notice = "Discarded " + n + " message(s): they will never be delivered; the messages they held back follow."
	}
	u.render(w, r, "dead", pageData{Title: "Dead letters", Notice: notice, Data: deadData{Messages: msgs, Limit: deadLimit}})
}

// requeue moves the dead letters a form names back to pending: the one
// of the row's button ("one"), or the selected ones ("id").
func (u *ui) requeue(w http.ResponseWriter, r *http.Request) {
	if err := r.ParseForm(); err != nil {
		u.fail(w, r, http.StatusBadRequest, err)
		return
	}
	ids := formIDs(r)
	if len(ids) == 0 {
		seeOther(w, "dead?requeued=0")
		return
	}
	n, err := u.d.Requeue(r.Context(), outbox.RequeueFilter{EventIDs: ids, Limit: len(ids)})
	if err != nil {
		u.fail(w, r, http.StatusInternalServerError, err)
		return
	}
	if r.PostForm.Get("back") == "message" && len(ids) == 1 {
		seeOther(w, "message?id="+url.QueryEscape(ids[0])+"&requeued="+strconv.Itoa(n))
		return
	}
	seeOther(w, "dead?requeued="+strconv.Itoa(n))
}

// formIDs returns the event ids a dead letters' form names: the one of
// the row's button ("one"), or the selected ones ("id").
func formIDs(r *http.Request) []string {
	if one := r.PostForm.Get("one"); one != "" {
		return []string{one}
	}
	return r.PostForm["id"]
}

type discardData struct {
	Messages []outboxinspect.MessageInfo
}

// discard takes the dead letters a form names out of delivery for good,
// in two steps: without confirm=yes it shows them and asks to confirm
// (nothing changes); with it, it discards them.
func (u *ui) discard(w http.ResponseWriter, r *http.Request) {
	if err := r.ParseForm(); err != nil {
		u.fail(w, r, http.StatusBadRequest, err)
		return
	}
	ids := formIDs(r)
	if len(ids) == 0 {
		seeOther(w, "dead?discarded=0")
		return
	}
	if r.PostForm.Get("confirm") != "yes" {
		msgs, err := u.in.Messages(r.Context(), outboxinspect.MessageFilter{States: []string{outbox.StateFailed}, EventIDs: ids,
			Order: outboxinspect.OldestFirst, Limit: len(ids)})
		if err != nil {
			u.fail(w, r, http.StatusInternalServerError, err)
			return
		}
		u.render(w, r, "discard", pageData{Title: "Discard dead letters", Data: discardData{Messages: msgs}})
		return
	}
	n, err := u.d.Discard(r.Context(), outbox.RequeueFilter{EventIDs: ids, Limit: len(ids)})
	if err != nil {
		u.fail(w, r, http.StatusInternalServerError, err)
		return
	}
	seeOther(w, "dead?discarded="+strconv.Itoa(n))
}

type messageData struct {
	M          outboxinspect.MessageInfo
	Payload    string
	Headers    []header
	Neighbours []outboxinspect.MessageInfo
	Held       string
	Blocker    string // event id of what holds it back, if anything
}

type header struct{ Key, Value string }

const neighbourSpan = 5

func (u *ui) message(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	m, err := u.in.Message(ctx, r.URL.Query().Get("id"))
	if errors.Is(err, outboxinspect.ErrMessageNotFound) {
		u.fail(w, r, http.StatusNotFound, err)
		return
	}
	if err != nil {
		u.fail(w, r, http.StatusInternalServerError, err)
		return
	}
	data := messageData{M: m, Payload: pretty(m.Payload)}
	for k, v := range m.Headers {
		data.Headers = append(data.Headers, header{k, v})
	}
	sort.Slice(data.Headers, func(i, j int) bool { return data.Headers[i].Key < data.Headers[j].Key })
	agg := outboxinspect.MessageFilter{AggregateType: m.AggregateType, AggregateID: m.AggregateID, Order: outboxinspect.SequenceOrder}
	around := agg
	around.SequenceFrom, around.SequenceTo, around.Limit = max(1, m.Sequence-neighbourSpan), m.Sequence+neighbourSpan, 2*neighbourSpan+1
	if data.Neighbours, err = u.in.Messages(ctx, around); err != nil {
		u.fail(w, r, http.StatusInternalServerError, err)
		return
	}
	ahead := agg
	ahead.States = []string{outbox.StatePending, outbox.StateDelivering, outbox.StateRetry, outbox.StateFailed}
	ahead.SequenceTo, ahead.Limit = m.Sequence-1, 1
	var blockers []outboxinspect.MessageInfo
	if m.Sequence > 1 && m.State != outbox.StateDelivered {
		if blockers, err = u.in.Messages(ctx, ahead); err != nil {
			u.fail(w, r, http.StatusInternalServerError, err)
			return
		}
	}
	data.Held, data.Blocker = heldBack(m, blockers, time.Now())
	notice := ""
	if n := r.URL.Query().Get("requeued"); n != "" {
		notice = "Requeued " + n + " message(s)."
	}
	u.render(w, r, "message", pageData{Title: "Message " + m.EventID, Notice: notice, Data: data})
}

// heldBack says where m stands in its aggregate: what it waits for, or
// what waits for it. blockers holds the first undelivered message before
// it, if there is one.
func heldBack(m outboxinspect.MessageInfo, blockers []outboxinspect.MessageInfo, now time.Time) (string, string) {
	if m.State == outbox.StateDelivered {
		return "Delivered " + ago(m.DeliveredAt, now) + ".", ""
	}
	if len(blockers) > 0 {
		b := blockers[0]
		why := ""
		switch b.State {
		case outbox.StateFailed:
			why = fmt.Sprintf("a dead letter (failed after %d attempt(s): %s). Requeue it to release this aggregate", b.Attempts, orNone(b.LastError))
		case outbox.StateRetry:
			why = fmt.Sprintf("waiting to be retried %s (attempt %d failed: %s)", ago(b.NextAttemptAt, now), b.Attempts, orNone(b.LastError))
		case outbox.StateDelivering:
			why = "being delivered (lease until " + stamp(b.LockedUntil) + ")"
		default:
			why = "pending, due " + ago(b.NextAttemptAt, now)
		}
		return fmt.Sprintf("Held back: sequence %d of this aggregate must be delivered first, and it is %s.", b.Sequence, why), b.EventID
	}
	switch m.State {
	case outbox.StateFailed:
		return fmt.Sprintf("Dead-lettered after %d attempt(s). It holds back the later messages of its aggregate until it is requeued.", m.Attempts), ""
	case outbox.StateDelivering:
		return "Being delivered: leased until " + stamp(m.LockedUntil) + ".", ""
	case outbox.StateRetry:
		return fmt.Sprintf("Nothing before it waits; it is retried %s after %d failed attempt(s).", ago(m.NextAttemptAt, now), m.Attempts), ""
	}
	return "Nothing before it waits; it is delivered at the next claim (due " + ago(m.NextAttemptAt, now) + ").", ""
}

func orNone(s string) string {
	if s == "" {
		return "no error recorded"
	}
	return s
}

// pretty indents a JSON document for reading, and writes the characters
// that encoding/json stores escaped (<, >, &) as themselves: the page
// escapes them for HTML, and shows what the payload says.
func pretty(raw json.RawMessage) string {
	var b bytes.Buffer
	if err := json.Indent(&b, raw, "", "  "); err != nil {
		return string(raw)
	}
	in := b.Bytes()
	out := make([]byte, 0, len(in))
	for i := 0; i < len(in); i++ {
		if in[i] != '\\' || i+1 == len(in) {
			out = append(out, in[i])
			continue
		}
		if in[i+1] == 'u' && i+6 <= len(in) {
			if c, ok := map[string]byte{"003c": '<', "003e": '>', "0026": '&'}[strings.ToLower(string(in[i+2:i+6]))]; ok {
				out = append(out, c)
				i += 5
				continue
			}
		}
		out = append(out, in[i], in[i+1]) // an escape pair, such as \\ or \"
		i++
	}
	return string(out)
}

type searchData struct {
	Query    string
	Messages []outboxinspect.MessageInfo
	Searched bool
}

const searchLimit = 200

// search finds an event by id, or else the messages of an aggregate:
// "type/id" names both, a bare word the aggregate id of any type.
func (u *ui) search(w http.ResponseWriter, r *http.Request) {
	q := strings.TrimSpace(r.URL.Query().Get("q"))
	data := searchData{Query: q}
	if q == "" {
		u.render(w, r, "search", pageData{Title: "Search", Data: data})
		return
	}
	ctx := r.Context()
	if _, err := u.in.Message(ctx, q); err == nil {
		seeOther(w, "message?id="+url.QueryEscape(q))
		return
	} else if !errors.Is(err, outboxinspect.ErrMessageNotFound) {
		u.fail(w, r, http.StatusInternalServerError, err)
		return
	}
	f := outboxinspect.MessageFilter{AggregateID: q, Order: outboxinspect.SequenceOrder, Limit: searchLimit}
	if typ, id, ok := strings.Cut(q, "/"); ok {
		f.AggregateType, f.AggregateID = typ, id
	}
	msgs, err := u.in.Messages(ctx, f)
	if err != nil {
		u.fail(w, r, http.StatusInternalServerError, err)
		return
	}
	data.Messages, data.Searched = msgs, true
	u.render(w, r, "search", pageData{Title: "Search", Data: data})
}
