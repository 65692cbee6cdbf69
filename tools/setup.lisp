;;;; Loaded first by every make target: ASDF, and this checkout as a place
;;;; to find systems, besides Debian's /usr/share/common-lisp.
;;;;
;;;; HUNCHENTOOT in the environment names another Hunchentoot's source
;;;; folder (the one holding hunchentoot.asd), found ahead of Debian's; its
;;;; fasls, and ours compiled against it, go to a cache folder of its own,
;;;; so that fasls built against one Hunchentoot never load with another.

(require :asdf)

(defun hunchentoot-override ()
  "The folder HUNCHENTOOT names, as a directory pathname, or NIL when unset."
  (let ((folder (uiop:getenv "HUNCHENTOOT")))
    (when (and folder (plusp (length folder)))
      (let ((directory (uiop:ensure-directory-pathname (uiop:parse-native-namestring folder))))
        (unless (probe-file (merge-pathnames "hunchentoot.asd" directory))
          (format *error-output* "~&HUNCHENTOOT=~A has no hunchentoot.asd: it must name a Hunchentoot ~
                                  source folder (../shared/vendor/hunchentoot-1.3.1, for example).~%"
                  folder)
          (uiop:quit 2))
        (truename directory)))))

(defparameter *checkout*
  (uiop:pathname-parent-directory-pathname (uiop:pathname-directory-pathname *load-truename*))
  "This checkout's folder.")

(defun find-systems-in (&rest folders)
  "Let ASDF find systems in FOLDERS first, then in HUNCHENTOOT's folder, this
checkout and Debian's."
  (let ((hunchentoot (hunchentoot-override)))
    (asdf:initialize-source-registry
     `(:source-registry
       ,@(loop for folder in folders collect `(:directory ,folder))
       ,@(when hunchentoot `((:directory ,hunchentoot)))
       (:directory ,*checkout*)
       :inherit-configuration))))

(find-systems-in)

(let ((hunchentoot (hunchentoot-override)))
  (when hunchentoot
    (asdf:initialize-output-translations
     `(:output-translations
       (t (,(uiop:xdg-cache-home "common-lisp" "hunchentoot-recycling-taskmaster"
                                 (format nil "~{~A~^-~}/" (rest (pathname-directory hunchentoot))))
           :implementation :**/ :*.*.*))
       :inherit-configuration))
    (format t "~&;; Hunchentoot from ~A~%" hunchentoot)))
