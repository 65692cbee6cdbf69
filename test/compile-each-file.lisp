;;;; Run by the test HOUSE.EACH-FILE-COMPILES-ALONE-IN-ASD-ORDER in a fresh
;;;; SBCL: compiles each file of the library (and of its PostgreSQL store)
;;;; on its own, in the order of hunchentoot-recycling-taskmaster.asd, loading each after it compiles,
;;;; so that a call to a function (or a use of a macro or variable) that
;;;; only a later file defines is reported as undefined, and every other
;;;; warning the compiler gives is reported too.  Prints one line per such
;;;; reference or warning; exits 0 when there is none.

(load (merge-pathnames "../tools/setup.lisp" *load-truename*))

(defun source-files (component)
  "The library's source files under COMPONENT, in the .asd's order."
  (typecase component
    (asdf:cl-source-file (list component))
    (asdf:parent-component (mapcan #'source-files (asdf:component-children component)))))

(defun compile-alone (file output)
  "Compile FILE, an ASDF component, in a compilation unit of its own into
OUTPUT: the undefined references it makes and the other warnings it gets,
as two lists of lines of text."
  (let ((undefined '())
        (warnings '()))
    (handler-bind ((warning (lambda (warning)
                              (let ((line (format nil "~A: ~A" (asdf:component-name file) warning)))
                                (if (search "undefined" line)
                                    (push line undefined)
                                    (push line warnings)))
                              (muffle-warning warning))))
      (with-compilation-unit (:override t)
        (let ((*compile-verbose* nil) (*compile-print* nil))
          (compile-file (asdf:component-pathname file) :output-file output))))
    (values (reverse undefined) (reverse warnings))))

(defparameter *library-systems*
  '("hunchentoot-recycling-taskmaster" "hunchentoot-recycling-taskmaster/postgresql")
  "The library's systems, each after the ones it depends on.")

(let* ((systems (mapcar #'asdf:find-system *library-systems*))
       (files (mapcan #'source-files systems))
       (output-directory (merge-pathnames (format nil "hrt-compile-each-file-~36R/"
                                                  (random (expt 2 64) (make-random-state t)))
                                          (uiop:temporary-directory)))
       (undefined '())
       (warnings '()))
  (dolist (dependency (mapcan (lambda (system) (copy-list (asdf:system-depends-on system))) systems))
    (cond ((and (consp dependency) (eq (first dependency) :feature))
           (require (third dependency)))
          ((not (member dependency *library-systems* :test #'equal))
           (asdf:load-system dependency))))
  (unwind-protect
       (dolist (file files)
         (let ((output (merge-pathnames (format nil "~A-~A.fasl"
                                                (asdf:component-name (asdf:component-system file))
                                                (substitute #\- #\/ (asdf:component-name file)))
                                        output-directory)))
           (ensure-directories-exist output)
           (multiple-value-bind (file-undefined file-warnings) (compile-alone file output)
             (setf undefined (append undefined file-undefined)
                   warnings (append warnings file-warnings)))
           (load output)))
    (uiop:delete-directory-tree output-directory :validate t :if-does-not-exist :ignore))
  (format t "~{~A~%~}~{~A~%~}~D file~:P compiled, ~D undefined reference~:P, ~D other warning~:P~%"
          undefined warnings (length files) (length undefined) (length warnings))
  (uiop:quit (if (or undefined warnings) 1 0)))
