;;;; The rules of docs/contributing.md that a machine can check: each
;;;; library file compiles alone in the .asd's order, no library file is over
;;;; 400 lines, the layout table lists every file of the checkout, the
;;;; statistics table of docs/operations.md is *STATISTICS-KEYS*'s, and
;;;; serving/ uses no name of readiness/ but those of its face.

(in-package #:hunchentoot-recycling-taskmaster-test)

(def-suite house :in all :description "The layout and rules the docs promise.")
(in-suite house)

(defparameter *checkout*
  (asdf:system-source-directory "hunchentoot-recycling-taskmaster")
  "The folder of this checkout.")

(defun checkout-path (relative)
  (merge-pathnames relative *checkout*))

(defun relative-path (pathname)
  "PATHNAME's name relative to the checkout, with / between folders."
  (enough-namestring pathname *checkout*))

(defun text-between (text begin end)
  "The part of TEXT between the lines BEGIN and END, or NIL when either is missing."
  (let* ((start (search begin text))
         (stop (and start (search end text :start2 start))))
    (and stop (subseq text (+ start (length begin)) stop))))

(defun checkout-files ()
  "Every file of the checkout, relative to it, but those under .git/ (and
the .git file of a git worktree)."
  (let ((files '()))
    (uiop:collect-sub*directories
     *checkout* t
     (lambda (directory) (not (equal ".git" (car (last (pathname-directory directory))))))
     (lambda (directory)
       (dolist (file (uiop:directory-files directory))
         (push (relative-path file) files))))
    (remove ".git" files :test #'string=)))

(test house.each-file-compiles-alone-in-asd-order
  (multiple-value-bind (output error-output status)
      (uiop:run-program (list "sbcl" "--noinform" "--non-interactive" "--disable-debugger"
                              "--load" (namestring (checkout-path "test/compile-each-file.lisp")))
                        :output :string :error-output :string :ignore-error-status t)
    (is (eql 0 status) "a file uses what only a later file defines, or compiles with a warning:~%~A~A"
        (let ((lines (remove-if-not (lambda (line) (search ": " line))
                                    (uiop:split-string output :separator '(#\Newline)))))
          (format nil "~{~A~%~}" (last lines 40)))
        (if (eql 0 status) "" (subseq error-output (max 0 (- (length error-output) 2000)))))
    (is (search " 0 undefined references, 0 other warnings" output))))

(test house.every-system-says-who-what-and-under-which-license
  (dolist (name '("hunchentoot-recycling-taskmaster" "hunchentoot-recycling-taskmaster/postgresql"
                  "hunchentoot-recycling-taskmaster/postgresql-cluster" "hunchentoot-recycling-taskmaster/test"
                  "hunchentoot-recycling-taskmaster/compatibility" "hunchentoot-recycling-taskmaster/bench"
                  "hunchentoot-recycling-taskmaster/demo"))
    (let ((system (asdf:find-system name)))
      (is (asdf:system-author system) "~A has no :author" name)
      (is (asdf:system-license system) "~A has no :license" name)
      (is (asdf:system-description system) "~A has no :description" name)
      (is (asdf:component-version system) "~A has no :version" name))))

(test house.no-library-file-over-400-lines
  (dolist (file (directory (checkout-path "src/**/*.lisp")))
    (let ((lines (with-open-file (in file) (loop for line = (read-line in nil) while line count t))))
      (is (<= lines 400) "~A has ~D lines" (relative-path file) lines))))

(test house.layout-lists-every-file
  (let* ((table (text-between (uiop:read-file-string (checkout-path "docs/contributing.md"))
                              "<!-- layout: begin -->" "<!-- layout: end -->"))
         (listed (and table
                      (loop for line in (uiop:split-string table :separator '(#\Newline))
                            for path = (cl-ppcre:register-groups-bind (path) ("^\\| `([^`]+)` \\|" line) path)
                            when path collect path)))
         (folders (remove-if-not (lambda (path) (uiop:string-suffix-p path "/")) listed))
         (files (remove-if (lambda (path) (uiop:string-suffix-p path "/")) listed)))
    (is (not (null table)) "docs/contributing.md has its layout table")
    (dolist (file (checkout-files))
      (unless (some (lambda (folder) (uiop:string-prefix-p folder file)) folders)
        (is (member file files :test #'string=) "~A is not in the layout table" file)))
    (dolist (path listed)
      (is (probe-file (checkout-path path)) "the layout table lists ~A, which does not exist" path))))

(test house.statistics-table-is-the-keys
  (let ((documented (text-between (uiop:read-file-string (checkout-path "docs/operations.md"))
                                  (format nil "<!-- statistics-keys: begin -->~%")
                                  "<!-- statistics-keys: end -->")))
    (is (equal (hunchentoot-recycling-taskmaster::statistics-keys-table) documented)
        "docs/operations.md's table differs from *STATISTICS-KEYS*; it should read:~%~A"
        (hunchentoot-recycling-taskmaster::statistics-keys-table))))

(defun documentation-files ()
  "README.md and every docs/*.md, as pathnames."
  (cons (checkout-path "README.md") (directory (checkout-path "docs/*.md"))))

(defun file-octets (pathname)
  (with-open-file (in pathname :element-type '(unsigned-byte 8)) (file-length in)))

(test house.documentation-fits-an-evening
  "README under 12,000 bytes, docs/benchmarks.md under 20,000, each other
document of docs/ under 25,000: a concept a document, what is true now,
the history left to bench/profiles/ and the commit log."
  (is (< (file-octets (checkout-path "README.md")) 12000))
  (is (< (file-octets (checkout-path "docs/benchmarks.md")) 20000))
  (dolist (file (directory (checkout-path "docs/*.md")))
    (is (< (file-octets file) 25000) "~A holds ~D bytes" (relative-path file) (file-octets file))))

(defun relative-links (text)
  "The targets of TEXT's markdown links that are paths in the checkout: not
URLs, not anchors alone; without their #anchor."
  (let ((links '()))
    (cl-ppcre:do-register-groups (target) ("\\]\\(([^)\\s]+)\\)" text)
      (let ((path (subseq target 0 (position #\# target))))
        (unless (or (zerop (length path)) (search "://" target) (uiop:string-prefix-p "mailto:" target))
          (push path links))))
    links))

(test house.documentation-links-resolve
  "Every relative link of README and docs/ names a file of the checkout."
  (dolist (file (documentation-files))
    (dolist (link (relative-links (uiop:read-file-string file)))
      (is (probe-file (merge-pathnames link (uiop:pathname-directory-pathname file)))
          "~A links to ~A, which does not exist" (relative-path file) link))))

(test house.every-committed-report-is-cited
  "Each report committed under bench/results/ is cited by README or docs/:
the runs the docs quote, nothing else."
  (let ((documentation (format nil "~{~A~}" (mapcar #'uiop:read-file-string (documentation-files))))
        (reports (uiop:run-program (list "git" "-C" (namestring *checkout*) "ls-files" "bench/results")
                                   :output :lines)))
    (is (< (length reports) 100) "~D reports committed" (length reports))
    (dolist (report reports)
      (is (search (subseq report (length "bench/results/")) documentation)
          "~A is committed but cited nowhere" report))))

(defun file-symbols (file package)
  "Every symbol of PACKAGE that the forms of FILE, read in PACKAGE, name."
  (let ((symbols '())
        (*package* package))
    (labels ((walk (form)
               (cond ((and (symbolp form) (eq (symbol-package form) package)) (pushnew form symbols))
                     ((consp form) (walk (car form)) (walk (cdr form))))))
      (with-open-file (in file)
        (loop for form = (read in nil in)
              until (eq form in)
              do (walk form))))
    symbols))

(defun defined-under-p (symbol folder)
  "True when a function, macro, generic function or accessor named
SYMBOL is defined in a file under FOLDER of the checkout (the issue's
rule: a struct or class name used as a type does not count)."
  (let ((folder (namestring (checkout-path folder))))
    (loop for type in '(:function :macro :generic-function)
            thereis (loop for source in (ignore-errors (sb-introspect:find-definition-sources-by-name symbol type))
                          for path = (sb-introspect:definition-source-pathname source)
                            thereis (and path (uiop:string-prefix-p folder (namestring path)))))))

(test house.serving-uses-only-the-readiness-face
  (let* ((package (find-package "HUNCHENTOOT-RECYCLING-TASKMASTER"))
         (face (string-downcase
                (text-between (uiop:read-file-string (checkout-path "src/engine/readiness/face.lisp"))
                              ";;;; The face," "(in-package")))
         (used (sort (remove-if-not (lambda (symbol) (defined-under-p symbol "src/engine/readiness/"))
                                    (remove-duplicates
                                     (loop for file in (directory (checkout-path "src/engine/serving/*.lisp"))
                                           append (file-symbols file package))))
                     #'string< :key #'symbol-name)))
    ;; 35 when the face was written (issue 53); the held replies (deferred
    ;; replies and event streams, issue 54) added three; inflating
    ;; permessage-deflate messages within the memory budget two (issue 58);
    ;; HTTP/2 two, whether a connection speaks it and its turn (issue 57);
    ;; the reply batch two, a reply kept in it and one sent from it now
    ;; (issue 55).
    (is (<= 20 (length used) 44) "serving/ uses ~D names of readiness/: ~(~{~A~^ ~}~)" (length used) used)
    (dolist (symbol used)
      (is (cl-ppcre:scan (format nil "(?<![a-z0-9-])~A(?![a-z0-9-])" (cl-ppcre:quote-meta-chars (string-downcase symbol))) face)
          "serving/ uses ~(~A~), which readiness/face.lisp does not list" symbol))))
