package outbox

import (
	"fmt"
	"strings"

	"gorm.io/gorm"
	"gorm.io/gorm/clause"
)

// Updates and deletes on an engine without UPDATE ... RETURNING (MySQL,
// and deletes on MySQL 8) lock the rows their WHERE matches, run, and
// read the rows back by primary key (lockAndRead). Two kinds of statement
// need more than that, and the plugin takes GORM's built statement apart
// at its WHERE for them (builtStatement):
//
//   - one with a LIMIT writes only some of the rows its WHERE matches, and
//     without an ORDER BY that names a unique key, which ones is the
//     server's choice. The plugin locks the rows with the statement's
//     WHERE, ORDER BY and LIMIT, and runs the statement on exactly those
//     rows: its WHERE, ORDER BY and LIMIT replaced by the locked rows'
//     primary keys (and its ORDER BY kept, which orders the writes).
//   - an update that sets the primary key moves its row to a key the
//     rows locked do not have. The plugin reads the row back by the new
//     key, when the statement sets it to a value (a placeholder) and
//     locked one row at most; it refuses any other such update before it
//     runs.

// builtStatement is GORM's UPDATE or DELETE cut at its WHERE.
type builtStatement struct {
	head     string // UPDATE t SET ..., or DELETE FROM t
	headVars []any
	order    string // ORDER BY ..., or ""
	orderVar []any
	limited  bool // the statement has a LIMIT
}

// cutStatement cuts stmt's SQL at its WHERE, rebuilding its WHERE, ORDER
// BY and LIMIT clauses on their own to find where they start; it reports
// false when the SQL does not end with them as rebuilt.
func cutStatement(stmt *gorm.Statement) (builtStatement, bool) {
	var b builtStatement
	if c, ok := stmt.Clauses["LIMIT"]; ok {
		// An UPDATE or DELETE takes no OFFSET: one that has one runs as
		// GORM built it, and the server refuses it.
		if l, ok := c.Expression.(clause.Limit); ok && l.Limit != nil && *l.Limit >= 0 && l.Offset == 0 {
			b.limited = true
		}
	}
	tail, tailVars := buildClauses(stmt, "WHERE", "ORDER BY", "LIMIT")
	b.order, b.orderVar = buildClauses(stmt, "ORDER BY")
	sql := stmt.SQL.String()
	if tail == "" || !strings.HasSuffix(sql, " "+tail) || len(tailVars) > len(stmt.Vars) {
		return b, false
	}
	b.head = sql[:len(sql)-len(tail)-1]
	b.headVars = stmt.Vars[:len(stmt.Vars)-len(tailVars)]
	return b, true
}

// buildClauses builds stmt's clauses of names, as GORM builds them, on a
// statement of their own.
func buildClauses(stmt *gorm.Statement, names ...string) (string, []any) {
	sc := &gorm.Statement{DB: stmt.DB, Table: stmt.Table, TableExpr: stmt.TableExpr, Schema: stmt.Schema, Context: stmt.Context, Clauses: map[string]clause.Clause{}}
	for _, n := range names {
		if c, ok := stmt.Clauses[n]; ok {
			sc.Clauses[n] = c
		}
	}
	sc.Build(names...)
	return sc.SQL.String(), sc.Vars
}

// onKeys returns the statement restricted to the rows of keys: its WHERE,
// ORDER BY and LIMIT replaced by the primary key's IN list, its ORDER BY
// kept.
func (b builtStatement) onKeys(stmt *gorm.Statement, keys []any) (string, []any) {
	var sql strings.Builder
	sql.WriteString(b.head)
	sql.WriteString(" WHERE ")
	stmt.QuoteTo(&sql, clause.Column{Table: stmt.Table, Name: stmt.Schema.PrimaryFields[0].DBName})
	sql.WriteString(" IN (?" + strings.Repeat(",?", len(keys)-1) + ")")
	if b.order != "" {
		sql.WriteString(" " + b.order)
	}
	vars := make([]any, 0, len(b.headVars)+len(keys)+len(b.orderVar))
	vars = append(append(append(vars, b.headVars...), keys...), b.orderVar...)
	return sql.String(), vars
}

// newKey reports whether an UPDATE sets the primary key, and if so the
// value it sets, or an error when the plugin cannot know it. GORM writes
// each assignment as `column`=value, joined by commas.
func (b builtStatement) newKey(stmt *gorm.Statement) (key any, sets bool, err error) {
	update, _ := buildClauses(stmt, "UPDATE")
	set, ok := strings.CutPrefix(b.head, update+" SET ")
	if !ok {
		return nil, false, fmt.Errorf("the statement's SET clause cannot be read")
	}
	pk := stmt.Quote(stmt.Schema.PrimaryFields[0].DBName) + "="
	at := -1
	for i := strings.Index(set, pk); i >= 0; {
		if i == 0 || set[i-1] == ',' || set[i-1] == '.' {
			at = i
			break
		}
		next := strings.Index(set[i+1:], pk)
		if next < 0 {
			break
		}
		i += 1 + next
	}
	if at < 0 {
		return nil, false, nil
	}
	value := set[at+len(pk):]
	if end := strings.IndexByte(value, ','); end >= 0 {
		value = value[:end]
	}
	if value != "?" || strings.Count(set, "?") != len(b.headVars) {
		return nil, true, fmt.Errorf("it sets the primary key %s to an expression", stmt.Schema.PrimaryFields[0].DBName)
	}
	return b.headVars[strings.Count(set[:at], "?")], true, nil
}
