package outbox_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"
)

// citedTest is the name of a test or fuzz target in prose: Test or Fuzz,
// then a capital letter.
var citedTest = regexp.MustCompile(`\b(?:Test|Fuzz)[A-Z][A-Za-z0-9_]*`)

// repoFiles calls fn with the path of every file of the repository (both
// modules, bench included) whose name ends in suffix, outside hidden
// directories and testdata.
func repoFiles(t *testing.T, suffix string, fn func(path string)) {
	t.Helper()
	err := filepath.WalkDir(".", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if path != "." && (strings.HasPrefix(d.Name(), ".") || d.Name() == "testdata") {
				return filepath.SkipDir
			}
			return nil
		}
		if strings.HasSuffix(path, suffix) {
			fn(path)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// TestDocsCiteOnlyTestsThatExist: every test or fuzz target that the
// Markdown docs or a Go comment names is a function of some _test.go file
// of the repository, so that a reader who looks for the test that holds a
// promise finds it. The CHANGELOG is left out: a release note says what
// was tested then, under the names of then.
func TestDocsCiteOnlyTestsThatExist(t *testing.T) {
	fset := token.NewFileSet()
	defined := map[string]bool{}
	cited := map[string][]string{} // test name -> where it is cited
	cite := func(where, text string) {
		for _, name := range citedTest.FindAllString(text, -1) {
			cited[name] = append(cited[name], where)
		}
	}

	repoFiles(t, ".go", func(path string) {
		f, err := parser.ParseFile(fset, path, nil, parser.ParseComments|parser.SkipObjectResolution)
		if err != nil {
			t.Fatal(err)
		}
		if strings.HasSuffix(path, "_test.go") {
			for _, decl := range f.Decls {
				if fn, ok := decl.(*ast.FuncDecl); ok && fn.Recv == nil {
					defined[fn.Name.Name] = true
				}
			}
		}
		for _, group := range f.Comments {
			cite(fset.Position(group.Pos()).String(), group.Text())
		}
	})
	repoFiles(t, ".md", func(path string) {
		if path == "CHANGELOG.md" {
			return
		}
		raw, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		for i, line := range strings.Split(string(raw), "\n") {
			cite(path+":"+strconv.Itoa(i+1), line)
		}
	})

	if len(defined) < 100 || len(cited) < 20 {
		t.Fatalf("found %d tests and %d cited names: the walk missed the repository", len(defined), len(cited))
	}
	var dangling []string
	for name, where := range cited {
		if !defined[name] {
			dangling = append(dangling, name+" (cited at "+strings.Join(where, ", ")+")")
		}
	}
	sort.Strings(dangling)
	for _, d := range dangling {
		t.Errorf("no such test: %s", d)
	}
}
